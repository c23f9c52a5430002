"""Models named by Hugging Face Hub id, resolved through huggingface_hub's cache: loading and
generating offline from a cache laid out as the Hub's, revisions, and the one-line start-up
error when a model is neither cached nor reachable. This machine has no Hub: every test runs
against a local cache (``HF_HUB_OFFLINE``, or an endpoint that refuses connections)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.hub import looks_like_repo_id, resolve_model
from tests.checkpoints import make_checkpoint

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [0, 11, 12, 13, 14]}
KW = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)


def add_snapshot(cache: Path, repo_id: str, commit: str, src: Path, *refs: str) -> Path:
    """``src``'s files as the Hub cache holds ``repo_id`` at ``commit``, with ``refs`` (branch
    or tag names) pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture
def cache(tmp_path, checkpoints):
    a, b = checkpoints
    cache = tmp_path / "hub-cache"
    add_snapshot(cache, "org/tiny-llama", COMMIT_A, a, "main")
    add_snapshot(cache, "org/tiny-llama", COMMIT_B, b, "v2")
    return cache


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets


def greedy(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_hub_id_loads_from_the_cache_and_generates_as_its_folder(cache, checkpoints, offline):
    llm = LLM("org/tiny-llama", download_dir=str(cache), **KW)
    assert llm.engine.model_name == "org/tiny-llama"  # the served name stays the id
    assert greedy(llm) == greedy(LLM(str(checkpoints[0]), **KW))
    tagged = LLM("org/tiny-llama", revision="v2", download_dir=str(cache), **KW)
    assert greedy(tagged) == greedy(LLM(str(checkpoints[1]), **KW)) != greedy(llm)


def test_revisions_resolve_to_their_snapshots(cache, offline):
    snapshots = cache / "models--org--tiny-llama" / "snapshots"
    assert resolve_model("org/tiny-llama", None, str(cache)) == str(snapshots / COMMIT_A)
    assert resolve_model("org/tiny-llama", "v2", str(cache)) == str(snapshots / COMMIT_B)
    assert resolve_model("org/tiny-llama", COMMIT_B, str(cache)) == str(snapshots / COMMIT_B)


def test_not_cached_offline_is_a_one_line_start_up_error(cache, offline):
    with pytest.raises(ValueError) as e:
        LLM("org/not-there", download_dir=str(cache), **KW)
    assert str(e.value) == (f"model 'org/not-there' is not in the Hugging Face cache ({cache}) "
                            "and HF_HUB_OFFLINE is set, so it cannot be downloaded")
    with pytest.raises(ValueError) as e:
        resolve_model("org/tiny-llama", "v9", str(cache))
    assert str(e.value) == (f"model 'org/tiny-llama' at revision 'v9' is not in the Hugging Face "
                            f"cache ({cache}) and HF_HUB_OFFLINE is set, so it cannot be "
                            "downloaded")


def test_a_partly_cached_snapshot_is_named(cache, checkpoints, offline):
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    snapshot = add_snapshot(cache, "org/partial", COMMIT_A, checkpoints[0], "main")
    (snapshot / "model.safetensors").unlink()  # an interrupted download, as the library sees it
    listing = {name: TreeCacheEntry(size=1, blob_id="0" * 40)
               for name in ("config.json", "model.safetensors", "modeling_x.py")}
    write_tree_cache(str(cache / "models--org--partial"), COMMIT_A, listing)
    with pytest.raises(ValueError) as e:
        resolve_model("org/partial", None, str(cache))
    assert str(e.value) == (f"model 'org/partial': the cached copy in {cache} is incomplete and "
                            "HF_HUB_OFFLINE is set, so it cannot be completed")


def test_a_local_folder_wins_and_a_missing_path_is_named(tmp_path, checkpoints):
    assert resolve_model(str(checkpoints[0])) == str(checkpoints[0])
    for path in ("/nonexistent/model", "./model", "a/b/c", "../x"):
        with pytest.raises(ValueError) as e:
            LLM(path, **KW)
        assert str(e.value) == (f"model: {path!r} is not a folder, nor a Hugging Face Hub "
                                "repository id (owner/name)")
    assert [looks_like_repo_id(m) for m in ("gpt2", "Qwen/Qwen2.5-7B-Instruct", "org/x.y_z",
                                            "/abs", "org/", "a/b/c", "~/x")] == \
        [True, True, True, False, False, False, False]


# hub.py alone (not the engine package, which imports torch), in a fresh interpreter
RESOLVE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("hub", sys.argv[1])
hub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hub)
for model in sys.argv[2:]:
    try:
        print(hub.resolve_model(model))
    except ValueError as e:
        print("ValueError:", e)
"""


def resolve_in_process(*models: str, **env: str) -> list[str]:
    """``resolve_model`` of each of ``models`` in a fresh interpreter with ``env``
    (huggingface_hub reads its variables when imported): a line of output each."""
    hub = Path(__file__).parents[2] / "engine" / "models" / "hub.py"
    run = subprocess.run([sys.executable, "-c", RESOLVE, str(hub), *models],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_the_hub_variables_are_the_librarys_own(cache):
    snapshot = cache / "models--org--tiny-llama" / "snapshots" / COMMIT_A
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    assert resolve_in_process("org/tiny-llama", "org/other", **env) == [str(snapshot), (
        f"ValueError: model 'org/other' is not in the Hugging Face cache ({cache}) and "
        "HF_HUB_OFFLINE is set, so it cannot be downloaded")]
    # online, with a Hub that refuses connections: the cache still serves, and the error says
    unreachable = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
                   "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert resolve_in_process("org/tiny-llama", "org/other", **unreachable) == [
        str(snapshot), f"ValueError: model 'org/other' is not in the Hugging Face cache "
        f"({cache}) and the Hugging Face Hub cannot be reached, so it cannot be downloaded"]

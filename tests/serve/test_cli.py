"""``pagedserve``: its flags -> ``AppConfig``, ``generate`` against the offline engine, and
``serve`` as a user runs it (start, /health, a completion, Ctrl-C, nothing left)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest

from serve_app.cli import app_fields, build_parser, engine_fields, serve_settings
from serve_app.config import AppConfig

from ..checkpoints import make_checkpoint
from .cluster import ROOT, free_port, wait_until

PROMPTS = ["Hello, my name is", "The quick brown fox"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("cli-llama")))


def test_vllm_flags_map_onto_app_config(model_path, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("min_replicas: 1\nmax_replicas: 3\n")
    cfg, host, port = serve_settings([
        model_path, "--tensor-parallel-size", "2", "--dtype", "bfloat16", "--max-model-len",
        "4096", "-q", "int8", "--api-key", "sk-1", "--served-model-name", "tiny",
        "--port", "9001", "--host", "0.0.0.0", "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.8", "--kv-cache-dtype", "fp8", "--max-num-seqs", "64",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-n", "4",
        "--autoscaling", str(policy), "--block-size", "32", "--enforce-eager",
        "--revision", "v2", "--generation-config", "vllm"])
    assert (host, port) == ("0.0.0.0", 9001)
    assert cfg == AppConfig(
        model=model_path, tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096,
        quantization="int8", api_key="sk-1", served_model_name="tiny",
        enable_prefix_caching=False, gpu_memory_utilization=0.8, kv_cache_dtype="fp8",
        max_num_seqs=64, tool_call_parser="hermes", max_n=4, autoscaling=str(policy),
        block_size=32, enforce_eager=True, revision="v2", generation_config="vllm")
    # vLLM's other names; nothing given: every default is AppConfig's own
    cfg, host, port = serve_settings(["-tp", "2", "-dp", "3", "--kv-cache-memory", "1048576"])
    assert cfg == AppConfig(tensor_parallel_size=2, num_workers=3,
                            kv_cache_memory_bytes=1 << 20)
    assert serve_settings([]) == (AppConfig(), "127.0.0.1", 8000)


def test_every_setting_has_its_flag(capsys):
    from serve_app.config.app import _ENGINE_KEYS

    assert set(engine_fields()) == _ENGINE_KEYS  # every engine key AppConfig takes flat
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    # option lines start two spaces in ("  -tp INT, --tensor-parallel-size INT  help...")
    flags = {flag for line in capsys.readouterr().out.splitlines() if line.startswith("  -")
             for flag in re.findall(r"--[a-z0-9-]+", line.split("  ")[1])}
    names = {"--" + k.replace("_", "-") for k in {*app_fields(), *engine_fields()} - {"model"}}
    assert names - flags == set()
    assert flags - names == {"--help", "--host", "--port", "--enable-auto-tool-choice",
                             "--data-parallel-size", "--kv-cache-memory"} | {
        "--no-" + k.replace("_", "-") for k, f in {**app_fields(), **engine_fields()}.items()
        if f.annotation in (bool, bool | None)}


@pytest.mark.parametrize("argv, message", [
    (["/no/such/folder"], "model folder '/no/such/folder' does not exist (nor is it a Hub id "
                          "owner/name)"),
    (["--max-model-len", "zero"], "argument --max-model-len: invalid int value: 'zero'"),
    (["--max-model-len", "0"], "--max-model-len: Input should be greater than or equal to 1"),
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4' (choose from 'auto', "
                          "'float32', 'bfloat16', 'float16')"),
    (["--block-size", "7"], "block_size must be a power of two in [8, 128], got 7"),
    (["--api-key", " "], "--api-key: must not be empty or whitespace; leave api_key unset to "
                         "serve without authentication"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--trust-remote-code"], "unrecognized arguments: --trust-remote-code"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_settings(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: pagedserve serve [MODEL] [--flag VALUE ...]",
        f"pagedserve serve: error: {message}"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_the_offline_engines_text(model_path):
    from engine import LLM, SamplingParams

    llm = LLM(model=model_path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    texts = [o.outputs[0].text for o in want]
    assert all(texts)
    out = _cli("generate", model_path, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
               "--max-tokens", "10", "--dtype", "float32", "--kv-cache-memory-bytes",
               str(8 << 20))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "".join(t + "\n" for t in texts)
    missing = _cli("generate", "/no/such/folder", "--prompt", "x")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.splitlines()[-1] == ("pagedserve generate: error: model folder "
                                               "'/no/such/folder' does not exist (nor is it a "
                                               "Hub id owner/name)")


def _marked(mark: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds ``mark``."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or mark.encode() not in (d / "environ").read_bytes() \
                    .split(b"\0") or (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_answers_then_ctrl_c_ends_it(model_path):
    """``pagedserve serve`` as a user starts it in a terminal: its own Ray cluster, the HTTP
    port it was given; Ctrl-C (SIGINT to the foreground group) ends it with status 0 and
    leaves no process behind. It is started with SIGINT ignored, as a non-interactive shell
    starts a background job (``make serve &``): the command installs its own handler."""
    from engine import LLM, SamplingParams

    (want,) = LLM(model=model_path, dtype="float32", kv_cache_memory_bytes=8 << 20).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    temp_dir = tempfile.mkdtemp(prefix="psc-", dir="/tmp")
    token = uuid.uuid4().hex  # in the environment of every process the run starts
    mark = f"PAGEDSERVE_CLI_TEST={token}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=temp_dir, PYTHONPATH=str(ROOT), PAGEDSERVE_CLI_TEST=token)
    port = free_port()
    log = Path(temp_dir, "serve.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.cli", "serve", model_path, "--port", str(port),
             "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20), "--num-threads",
             "1", "--served-model-name", "tiny", "--api-key", "sk-cli"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    base, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-cli"}
    try:
        wait_until(lambda: proc.poll() is not None or
                   httpx.get(f"{base}/health", timeout=5).status_code == 200, 240, "healthy")
        assert proc.poll() is None, log.read_text()[-3000:]
        resp = httpx.post(f"{base}/v1/completions", headers=key, timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want.outputs[0].text
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}).status_code == 401
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
        wait_until(lambda: not _marked(mark), 30, "every process of the run gone")
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

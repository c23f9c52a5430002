"""generation_config.json's sampling defaults, as vLLM's ``--generation-config``: ``auto``
applies the model's to what a request leaves unset, ``vllm`` ignores them, a folder supplies its
own; bad values stop start-up naming the file."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.models.generation_config import default_sampling
from tests.checkpoints import make_checkpoint

PROMPTS = [{"prompt_token_ids": [0, 11, 12, 13, 14]}, {"prompt_token_ids": [0, *range(300, 320)]}]
KW = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
# top_k 1 picks the most likely token (greedy, whatever the temperature), the penalty and the
# length change what it picks and how much; do_sample is not read (vLLM ignores it too)
GENERATION = {"top_k": 1, "repetition_penalty": 1.8, "max_new_tokens": 9, "top_p": 0.9,
              "do_sample": True, "eos_token_id": [1, 700], "bos_token_id": 0}
FROM_FILE = SamplingParams(top_k=1, repetition_penalty=1.8, max_tokens=9, top_p=0.9)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("gen"))
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), **KW)


def run(llm: LLM, params: SamplingParams | None = None) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_the_files_defaults_are_the_default_params(llm):
    assert llm.engine.default_sampling == {"top_k": 1, "repetition_penalty": 1.8,
                                           "max_tokens": 9, "top_p": 0.9}
    assert llm.get_default_sampling_params() == FROM_FILE
    assert run(llm) == run(llm, FROM_FILE)  # generate() without params takes them
    assert [len(t) for t in run(llm)] == [9, 9]
    assert llm.engine.eos_token_ids == {1, 700}
    # not the neutral defaults: the penalty changes the tokens
    neutral = run(llm, SamplingParams(top_k=1, max_tokens=9, top_p=0.9))
    assert neutral != run(llm)


def test_vllm_ignores_the_file_and_a_folder_replaces_it(ckpt, tmp_path):
    llm = LLM(str(ckpt), generation_config="vllm", **KW)
    assert llm.engine.default_sampling == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.engine.eos_token_ids == {1, 700}  # the file's EOS ids stop it still, as vLLM's
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                                 "top_k": 0}))
    assert default_sampling(str(ckpt), str(tmp_path)) == {"temperature": 0.0, "top_k": -1}
    assert default_sampling(str(tmp_path / "nothing-here")) == {}  # auto: no file, no defaults


@pytest.mark.parametrize(("content", "message"), [
    ({"temperature": -1}, "temperature must be in [0, 100], got -1"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"max_new_tokens": True}, "max_tokens must be an integer, got True"),
])
def test_bad_values_are_start_up_errors_naming_the_file(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError) as e:
        default_sampling(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'generation_config.json'}: {message}"


def test_a_bad_setting_is_named(ckpt, tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(str(ckpt), generation_config=str(tmp_path / "nope"), **KW)
    assert str(e.value) == ("generation_config must be 'auto', 'vllm' or a folder holding a "
                            f"generation_config.json; {str(tmp_path / 'nope')!r} is neither")

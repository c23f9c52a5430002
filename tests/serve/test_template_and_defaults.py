"""The Router's prompt building without Ray: the app's chat_template, a request's
chat_template_kwargs, add_generation_prompt and continue_final_message (exact rendered ids and
400s), and generation_config.json's defaults for the fields a request leaves unset."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine import LLM, SamplingParams
from serve_app.config import AppConfig
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request
from serve_app.router.prompts import PromptProcessor
from tests.checkpoints import make_checkpoint

THINKING = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking %}<think>{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
GENERATION = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2, "max_new_tokens": 9}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama"))
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)


def processor(llm: LLM, **app: object) -> PromptProcessor:
    info = {"tokenizer": llm.engine.tokenizer, "max_model_len": MAX_MODEL_LEN,
            "vocab_size": llm.engine.vocab_size, "model_name": "m",
            "default_sampling": llm.engine.default_sampling}
    return PromptProcessor.for_app(info, AppConfig(**app))  # type: ignore[arg-type]


def chat(**body: object) -> ChatCompletionRequest:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    return req


def ids(llm: LLM, text: str) -> list[int]:
    return list(llm.engine.tokenizer(text, add_special_tokens=False).input_ids)


USER = {"role": "user", "content": "Hi"}
PARTIAL = {"role": "assistant", "content": "Hello, my"}


def test_the_tokenizers_template_continues_the_final_message(llm):
    p = processor(llm)
    [got] = p.prepare_chat(chat(messages=[USER, PARTIAL], add_generation_prompt=False,
                                    continue_final_message=True)).prompts
    assert got == ids(llm, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, my")
    [got] = p.prepare_chat(chat(messages=[USER], add_generation_prompt=False)).prompts
    assert got == ids(llm, "<|im_start|>user\nHi<|im_end|>\n")
    [got] = p.prepare_chat(chat(messages=[USER])).prompts
    assert got == ids(llm, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_apps_template_file_or_text_takes_the_requests_kwargs(llm, tmp_path):
    (tmp_path / "thinking.jinja").write_text(THINKING)
    for setting in (str(tmp_path / "thinking.jinja"), THINKING):
        p = processor(llm, chat_template=setting)
        assert p.chat_template == THINKING
        [got] = p.prepare_chat(chat(messages=[USER],
                                        chat_template_kwargs={"enable_thinking": True})).prompts
        assert got == ids(llm, "[user]Hi<think>[assistant]")
        [got] = p.prepare_chat(chat(messages=[USER])).prompts
        assert got == ids(llm, "[user]Hi[assistant]")
        [got] = p.prepare_chat(chat(messages=[USER, PARTIAL], add_generation_prompt=False,
                                        continue_final_message=True)).prompts
        assert got == ids(llm, "[user]Hi[assistant]Hello, my")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": [USER, PARTIAL], "continue_final_message": True}, "continue_final_message",
     "continue_final_message: cannot be true together with add_generation_prompt (true by "
     "default); set add_generation_prompt to false"),
    ({"messages": [PARTIAL, USER], "continue_final_message": True,
      "add_generation_prompt": False}, "continue_final_message",
     "continue_final_message: needs the last message to be the assistant's (it is the user's)"),
    ({"messages": [USER], "chat_template_kwargs": {"tokenize": True, "chat_template": "x"}},
     "chat_template_kwargs", "chat_template_kwargs: must not set chat_template, tokenize (set "
     "through the request's own fields or by the server)"),
    ({"messages": [USER], "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
     "chat_template_kwargs: Input should be an object"),
])
def test_bad_template_options_are_400s_naming_the_field(body, param, message):
    with pytest.raises(APIError) as e:
        chat(**body)
    err = e.value.body()["error"]
    assert (e.value.status, err["param"], err["type"]) == (400, param, "invalid_request_error")
    assert err["message"].split(" (got ")[0] == message


@pytest.mark.parametrize(("setting", "message"), [
    ("/no/such/template.jinja", "chat_template: '/no/such/template.jinja' is neither a file nor "
     "a Jinja template"),
    ("Hi\n{{ name", "chat_template: not a valid Jinja template (line 2: unexpected end of "
     "template, expected 'end of print statement'.)"),
])
def test_a_bad_template_setting_stops_start_up(setting, message):
    with pytest.raises(ValidationError) as e:  # a ValueError, naming the field
        AppConfig(chat_template=setting)
    [err] = e.value.errors()
    assert (err["loc"], err["msg"]) == (("chat_template",), f"Value error, {message}")


def test_generation_defaults_fill_what_the_request_left_unset(llm):
    p = processor(llm)
    prompt = [0, 11, 12, 13]
    [omitted] = p.prepare_completion(parse_request(
        CompletionRequest, json.dumps({"prompt": prompt, "max_tokens": 30}).encode())).params
    [explicit] = p.prepare_completion(parse_request(CompletionRequest, json.dumps(
        {"prompt": prompt, "max_tokens": 30, "temperature": 0.3, "top_k": 7,
         "repetition_penalty": 1.2}).encode())).params
    assert omitted == explicit
    assert (omitted.temperature, omitted.top_k, omitted.repetition_penalty, omitted.top_p,
            omitted.max_tokens) == (0.3, 7, 1.2, 1.0, 30)
    # what the client sets wins, even when it is the neutral value
    [mine] = p.prepare_completion(parse_request(CompletionRequest, json.dumps(
        {"prompt": prompt, "temperature": 1.0, "top_k": -1}).encode())).params
    assert (mine.temperature, mine.top_k, mine.repetition_penalty, mine.max_tokens) == \
        (1.0, -1, 1.2, 9)  # max_new_tokens caps the unsent max_tokens (16 by default)
    [params] = p.prepare_chat(chat(messages=[USER])).params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 7, 9)
    [params] = p.prepare_chat(chat(messages=[USER], max_completion_tokens=40)).params
    assert params.max_tokens == 40


def test_defaults_change_generation_exactly_as_the_fields_would(llm):
    """The engine generates the same tokens for the request that omits the fields as for the
    one that sets them, and different ones without the defaults (generation_config 'vllm')."""
    p = processor(llm)
    body = {"prompt": [0, 11, 12, 13], "max_tokens": 12, "seed": 5}
    [omitted] = p.prepare_completion(parse_request(CompletionRequest,
                                                           json.dumps(body).encode())).params
    [explicit] = p.prepare_completion(parse_request(CompletionRequest, json.dumps(
        {**body, "temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2}).encode())).params
    info = {"tokenizer": llm.engine.tokenizer, "max_model_len": MAX_MODEL_LEN,
            "vocab_size": llm.engine.vocab_size, "model_name": "m", "default_sampling": {}}
    [neutral] = PromptProcessor.for_app(info, AppConfig()).prepare_completion(  # type: ignore[arg-type]
        parse_request(CompletionRequest, json.dumps(body).encode())).params

    def run(params: SamplingParams) -> list[int]:
        out = llm.generate({"prompt_token_ids": body["prompt"]}, params, use_tqdm=False)
        return out[0].outputs[0].token_ids

    assert run(omitted) == run(explicit) != run(neutral)

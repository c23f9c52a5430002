"""Prompt preparation in the Router: model name, chat template, tokenization, length limits.

Tokenizing and templating are CPU work proportional to the prompt: the Router runs them in a
thread (``Router._off_loop``), never on its event loop, so one 4 MiB prompt does not stall the
streams the Router carries. Encoding goes through the fast tokenizer's Rust ``encode_batch``,
which lets other threads run while it works, and a prompt longer than the model's context is
refused from its token count alone, before its ids become a Python list (for a 4 MiB prompt
that conversion alone held the interpreter for ~0.2 s).
"""

from __future__ import annotations

from typing import Any

from engine import SamplingParams
from serve_app.cluster.request_router import prefix_hashes
from serve_app.config import AppConfig
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest
from serve_app.protocol.sampling import sampling_params, with_defaults
from serve_app.protocol.tools import ToolPlan, template_has_tools
from serve_app.router.prepared import PreparedRequest, chat_output, completion_output
from serve_app.wire import ModelInfo


class PromptProcessor:
    """Built from a Worker's ``model_info()``: its tokenizer, model name, ``max_model_len`` and
    ``vocab_size``.

    Token ids are checked against the model's ``vocab_size`` (config.json's, the bound the
    engine checks), not the tokenizer's length, which may be smaller: an id this accepts is one
    the engine accepts.
    """

    def __init__(self, info: ModelInfo, model_name: str, prefix_chunk_tokens: int,
                 max_n: int = 16, max_tokens_limit: int | None = None,
                 max_prompts: int | None = None, tool_call_parser: str | None = None,
                 chat_template: str | None = None) -> None:
        self.tokenizer = info["tokenizer"]
        self.chat_template = chat_template  # the app's, over the tokenizer's (None: its own)
        # the model's generation_config.json defaults for fields a request leaves unset
        self.default_sampling: dict[str, Any] = info.get("default_sampling") or {}
        self._backend = _backend_copy(self.tokenizer)
        self.model_name = model_name
        self.max_model_len: int = info["max_model_len"]
        self.dtype: str | None = info.get("dtype")  # the Workers' activations dtype
        self.quantization: str | None = info.get("quantization")  # their weights' ("int8")
        self.kv_cache_dtype: str | None = info.get("kv_cache_dtype")  # their KV cache's
        self.vocab_size: int = info["vocab_size"]
        self._chunk = prefix_chunk_tokens
        self.max_n = max_n
        self.max_tokens_limit = max_tokens_limit
        self.max_prompts = max_prompts  # more sequences can never be admitted at once
        self.tool_call_parser = tool_call_parser

    @classmethod
    def for_app(cls, info: ModelInfo, cfg: AppConfig) -> PromptProcessor:
        """The Router's: the served name (``served_model_name``, else the Worker's) and the
        app's request bounds."""
        return cls(info, cfg.served_model_name or info["model_name"], cfg.prefix_chunk_tokens,
                   cfg.max_n, cfg.max_tokens_limit, cfg.max_waiting_requests,
                   cfg.tool_call_parser, cfg.chat_template)

    def check_size(self, num_prompts: int, n: int, max_tokens: int | None,
                   max_tokens_param: str = "max_tokens") -> None:
        """The bounds that keep one request from taking every KV block (400 beyond them)."""
        if n > self.max_n:
            raise APIError(400, f"n: must be at most {self.max_n} (got {n})", param="n")
        limit = self.max_tokens_limit
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"{max_tokens_param}: must be at most {limit} (got "
                           f"{max_tokens})", param=max_tokens_param)
        if self.max_prompts is not None and num_prompts * n > self.max_prompts:
            raise APIError(400, f"prompt: at most {self.max_prompts} sequences (prompts x n) "
                           f"per request (got {num_prompts} x {n})", param="prompt")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True,
               truncate: int | None = None) -> list[int]:
        """Token ids of ``text`` (``truncate``: its last N); a 400 when they cannot fit
        ``max_model_len`` with one output token."""
        if self._backend is None:
            ids: list[int] = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        else:
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        ids = ids[-truncate:] if truncate else ids
        self._check_length(len(ids))
        return ids

    def _check_length(self, num_tokens: int, max_tokens: int | None = None,
                      max_tokens_param: str = "max_tokens") -> None:
        limit = self.max_model_len
        if num_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"the prompt has {num_tokens} tokens (it must leave room for at least "
                           "one generated token).", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and num_tokens + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"{num_tokens + max_tokens} were requested ({num_tokens} in the prompt, "
                           f"{max_tokens} for the completion). Reduce the prompt or "
                           f"{max_tokens_param}.", param=max_tokens_param,
                           code="context_length_exceeded")

    def encode_completion(self, prompt: str | list[int], truncate: int | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, truncate=truncate)
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if max(prompt) >= self.vocab_size:
            raise APIError(400, f"prompt: token id {max(prompt)} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="prompt")
        return list(prompt[-truncate:] if truncate else prompt)

    def encode_chat(self, messages: list[dict[str, object]], add_generation_prompt: bool,
                    tools: list[dict[str, object]] | None = None,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, object] | None = None,
                    truncate: int | None = None) -> list[int]:
        """The conversation through the chat template (the app's, else the tokenizer's), with
        ``template_kwargs`` as the template's variables, tokenized."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except Exception as exc:  # the template raises jinja errors for bad conversations
            raise APIError(400, f"messages: the chat template rejected them: {exc}",
                           param="messages") from None
        return self.encode(text, add_special_tokens=False, truncate=truncate)

    def decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def params(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
               max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
        """One prompt's sampling parameters, after checking the prompt and output fit
        ``max_model_len``: the model's defaults (generation_config.json) and the app's
        (``max_tokens_limit``) go into the request's fields first, then ``SamplingParams`` is
        built, and checked, once."""
        self._check_length(len(prompt_ids), max_tokens, req.max_tokens_param)
        self._check_vocab(req)
        sent = req.model_fields_set  # what the client set wins over the defaults
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if self.max_tokens_limit is not None:
                max_tokens = min(max_tokens, self.max_tokens_limit)
        default_max = self.default_sampling.get("max_tokens")
        if default_max is not None and not sent & {"max_tokens", "max_completion_tokens"}:
            max_tokens = min(max_tokens, default_max)
        return sampling_params(with_defaults(req, self.default_sampling), max_tokens,
                               num_logprobs)

    def _check_vocab(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """Token ids the request names must lie in the model's vocabulary."""
        for name, ids in (("stop_token_ids", req.stop_token_ids),
                          ("allowed_token_ids", req.allowed_token_ids),
                          ("logit_bias", list(req.logit_bias_ids() or ()))):
            if ids and max(ids) >= self.vocab_size:
                raise APIError(400, f"{name}: token id {max(ids)} is outside the vocabulary "
                               f"[0, {self.vocab_size})", param=name)

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        """A completion request's prompts as token ids, their parameters, and its answer's
        shape (with ``echo``: the prompts' texts)."""
        raw = req.prompts()
        prompts = [self.encode_completion(x, req.truncate_prompt_tokens) for x in raw]
        params = [self.params(req, ids, req.max_tokens, req.logprobs) for ids in prompts]
        echo = [x if isinstance(x, str) else self.decode(x) for x in raw] if req.echo else None
        return PreparedRequest(prompts, params, completion_output(req, echo))

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        """A chat request's templated prompt as token ids, its parameters, and its answer's
        shape (with its tool plan)."""
        plan = self.tool_plan(req)
        tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan else None
        ids = self.encode_chat(req.chat_messages(), req.add_generation_prompt, tools,
                               req.continue_final_message, req.chat_template_kwargs,
                               req.truncate_prompt_tokens)
        params = self.params(req, ids, req.completion_limit(), req.num_logprobs())
        return PreparedRequest([ids], [params], chat_output(req, plan))

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """The request's tools, checked against this model and app (400 when "auto" cannot
        be served: no parser set, or a chat template without tools)."""
        plan = req.tool_plan(self.tool_call_parser)
        if plan is None or plan.mode != "auto":
            return plan
        if plan.parser is None:
            field = "tool_choice" if req.tool_choice is not None else "tools"
            raise APIError(400, f'{field}: tool_choice "auto" (the default with tools) needs '
                           "the app's tool_call_parser setting (hermes or llama3_json); "
                           '"required", a named function or "none" work without it',
                           param=field)
        if not (template_has_tools(self.tokenizer) if self.chat_template is None
                else "tools" in self.chat_template):
            raise APIError(400, "tools: this model's chat template does not render tools, so "
                           'the model cannot call them by itself; use tool_choice "required" '
                           "or a named function", param="tools")
        return plan

    def prefix_hashes(self, prompt_ids: list[int]) -> list[int]:
        return prefix_hashes(prompt_ids, self._chunk)


def _backend_copy(tokenizer: Any) -> Any:
    """The fast tokenizer's Rust ``Tokenizer``, copied with truncation and padding off (what
    ``tokenizer(text)`` applies by default), or None for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy

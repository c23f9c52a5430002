"""Prompt preparation in the Router: model name, chat template, tokenization, length limits."""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams
from serve_app.errors import APIError
from serve_app.protocol import sampling_params
from serve_app.request_router import prefix_hashes


class PromptProcessor:
    """Built from a Worker's ``model_info()``: its tokenizer, model name and ``max_model_len``."""

    def __init__(self, info: dict[str, Any], model_name: str, prefix_chunk_tokens: int,
                 max_n: int = 16, max_tokens_limit: int | None = None,
                 max_prompts: int | None = None) -> None:
        self.tokenizer = info["tokenizer"]
        self.model_name = model_name
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size = len(self.tokenizer)
        self._chunk = prefix_chunk_tokens
        self.max_n = max_n
        self.max_tokens_limit = max_tokens_limit
        self.max_prompts = max_prompts  # more can never be admitted at once

    def check_size(self, num_prompts: int, n: int, max_tokens: int | None) -> None:
        """The bounds that keep one request from taking every KV block (400 beyond them)."""
        if n > self.max_n:
            raise APIError(400, f"n: must be at most {self.max_n} (got {n})", param="n")
        limit = self.max_tokens_limit
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"max_tokens: must be at most {limit} (got {max_tokens})",
                           param="max_tokens")
        if self.max_prompts is not None and num_prompts > self.max_prompts:
            raise APIError(400, f"prompt: at most {self.max_prompts} prompts per request (got "
                           f"{num_prompts})", param="prompt")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")

    def encode_completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if max(prompt) >= self.vocab_size:
            raise APIError(400, f"prompt: token id {max(prompt)} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # the template raises jinja errors for bad conversations
            raise APIError(400, f"messages: the chat template rejected them: {exc}",
                           param="messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def params(self, req: Any, prompt_ids: list[int], max_tokens: int | None,
               num_logprobs: int | None) -> SamplingParams:
        """Sampling parameters, after checking the prompt and output fit ``max_model_len``."""
        limit, n = self.max_model_len, len(prompt_ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"the prompt has {n} tokens (it must leave room for at least one "
                           "generated token).", param="prompt", code="context_length_exceeded")
        if req.stop_token_ids and max(req.stop_token_ids) >= self.vocab_size:
            raise APIError(400, f"stop_token_ids: token id {max(req.stop_token_ids)} is outside "
                           f"the vocabulary [0, {self.vocab_size})", param="stop_token_ids")
        if max_tokens is None:
            max_tokens = limit - n
            if self.max_tokens_limit is not None:
                max_tokens = min(max_tokens, self.max_tokens_limit)
        elif n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"{n + max_tokens} were requested ({n} in the prompt, {max_tokens} "
                           "for the completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return sampling_params(req, max_tokens, num_logprobs)

    def prefix_hashes(self, prompt_ids: list[int]) -> list[int]:
        return prefix_hashes(prompt_ids, self._chunk)

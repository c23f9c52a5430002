"""From a prompt and its ``SamplingParams`` to the sequences the scheduler runs, as vLLM's input
processor: the prompt tokenized and bounded, the params validated (once) and checked against
the vocabulary, and the request's ``n`` sequences made, each with its bad words' token ids and
its grammar's matcher; the siblings of ``n > 1`` wait to share the first one's prompt blocks.
"""

from __future__ import annotations

from typing import Any

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.grammar.compiler import Grammars
from engine.sample.logits_processors import bad_words_ids, check_vocab_ids
from engine.tokenizer import PromptType, encode_prompt


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 eos_token_ids: frozenset[int], grammars: Grammars) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def process_prompt(self, prompt: PromptType, truncate: int | None = None,
                       ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt (``truncate``: keep its last N tokens); ``ValueError``
        naming the problem."""
        return encode_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len,
                             truncate)

    def check_request(self, prompt: PromptType, params: SamplingParams,
                      ) -> tuple[str | None, list[int]]:
        """Every check a request gets, queueing nothing: ``ValueError`` naming the problem,
        else the prompt's text and token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params.validate()
        check_vocab_ids(params, self.vocab_size)
        return self.process_prompt(prompt, params.truncate_prompt_tokens)

    def sequences(self, request_id: str, ids: list[int], params: SamplingParams,
                  arrival_time: float | None) -> list[Request]:
        """The request's ``params.n`` sequences over prompt ``ids`` (ids ``<request_id>#<i>``
        when n > 1)."""
        seqs = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params,
                        self.eos_token_ids, index=i, group_id=request_id,
                        arrival_time=arrival_time) for i in range(params.n)]
        bad_words = bad_words_ids(self.tokenizer, params.bad_words)
        for child in seqs[1:]:
            child.parent = seqs[0]
        for seq in seqs:
            seq.bad_words = bad_words
            if params.structured_outputs is not None:
                seq.grammar = self.grammars.state(params.structured_outputs)
        return seqs

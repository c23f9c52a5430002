"""``LLM``: the offline batch API, ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine, PromptType

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LLM:
    """Offline generation. Keyword arguments are ``EngineConfig`` fields, flat
    (``LLM(model=path, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=True)``).

    With ``tensor_parallel_size=N`` it spawns N-1 rank processes (one device each on CUDA), so a
    script that builds it needs the ``if __name__ == "__main__":`` guard; ``shutdown()`` (or
    dropping the object, or the interpreter exiting) stops them."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes, if any; no generation afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) unless the
        ``generation_config`` setting is 'vllm'; what ``generate`` uses when given none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Bad input raises
        ``ValueError`` before anything runs."""
        prompts = _prompt_list(prompts)
        params = (sampling_params if sampling_params is not None
                  else self.get_default_sampling_params())
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # every prompt and its params are checked before anything is queued
        checked = [self.engine.check_request(p, sp) for p, sp in zip(prompts, params)]
        ids = [f"offline-{self._counter + i}" for i in range(len(prompts))]
        self._counter += len(prompts)
        try:
            for rid, p, sp, c in zip(ids, prompts, params, checked):
                self.engine.add_request(rid, p, _final(sp), checked=c)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, tokens = time.monotonic(), 0
        try:
            while self.engine.has_unfinished():
                outputs = self.engine.step()
                for rid, err in self.engine.pop_errors():
                    raise RuntimeError(f"request {rid} failed: {err!r}") from err
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
                        tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{tokens / (time.monotonic() - start):.1f}")
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]



def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> Sequence[PromptType]:
    """One prompt (text, a dict, or token ids: a sequence whose first item is an int) as a
    list of one; a sequence of prompts as it is."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [cast("PromptType", prompts)]
    return cast("Sequence[PromptType]", prompts)

def _final(params: SamplingParams) -> SamplingParams:
    if params.output_kind == "final":
        return params
    from dataclasses import replace

    return replace(params, output_kind="final")


def main() -> None:
    parser = argparse.ArgumentParser(description="Offline generation with pagedserve's engine.")
    parser.add_argument("--model", default=None, help="checkpoint folder (default model if unset)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    prompts = args.prompt or ["Hello, my name is"]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(prompts, sp):
        c = out.outputs[0]
        print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")


if __name__ == "__main__":
    main()

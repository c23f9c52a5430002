"""Batched sampling: grammar masks, logit bias, penalties, min_tokens, temperature, top-k /
top-p / min-p, seeds, logprobs.

The batch's work is done in a few tensor ops; per-row Python runs only for the rows that ask for
penalties, a seed or one of vLLM's per-request processors (``logits_processors``). A sampled
row's token is drawn by ``random_sample`` at one uniform number per row; a seeded row draws it
from its own generator and gets the same tokens whatever else is in the batch. Logprobs are
those of the raw model distribution (log-softmax of the logits before any processing: bias,
penalties, masks), as vLLM returns by default; so are prompt logprobs, which the sampler writes
onto their requests (``Request.prompt_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.outputs import Logprob, Logprobs
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.grammar.compiler import GrammarState
from engine.sample.logits_processors import RowTensors, SeenTokens
from engine.sample.random_sample import sample
from kernels import ops

PROMPT_ROWS_AT_ONCE = 512  # prompt positions scored together (their float32 log-softmax)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.row_generators: dict[str, torch.Generator] = {}
        self.row_tensors = RowTensors()  # allowed ids and logit bias, per running request
        self.seen_tokens = SeenTokens()  # what the penalties count, per running request

    def forget(self, request_id: str) -> None:
        self.row_generators.pop(request_id, None)
        self.row_tensors.forget(request_id)
        self.seen_tokens.forget(request_id)

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 prompt_rows: Sequence[tuple[Request, int]] = ()) -> SamplerOutput:
        """Sample one token for each of ``reqs`` from the first ``len(reqs)`` rows of ``logits``;
        the rows after them score prompt tokens for ``prompt_rows`` (``batch_layout``)."""
        if prompt_rows:
            add_prompt_logprobs(logits[len(reqs):], prompt_rows)
            logits = logits[: len(reqs)]
        if not reqs:
            return SamplerOutput([], [])
        params = [r.params for r in reqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalties = any(p.needs_penalties for p in params)
        biased = any(p.logit_bias for p in params)
        all_greedy = all(p.greedy for p in params)
        grammars = [r.grammar for r in reqs]
        constrained = any(g is not None for g in grammars)
        native_mask = constrained and ops.can_mask_logits(logits)
        # masks are applied in place in the logits' dtype (the model's logits are not used
        # again) where the C kernel can; xgrammar's own masking takes float32
        if (want_logprobs or penalties or biased or not all_greedy
                or (constrained and not native_mask)):
            # The argmax of plain greedy rows is the same on the model's dtype (bfloat16 widens
            # to float32 exactly); everything else computes in float32.
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if constrained:
            mask_logits(logits, grammars, native_mask)
        if biased:  # before the penalties, as vLLM
            self.row_tensors.apply_logit_bias(logits, reqs)
        if penalties:
            self.seen_tokens.apply(logits, reqs)
        self._mask_early_stop(logits, reqs)
        self.row_tensors.apply_masks(logits, reqs)
        if all_greedy:
            tokens = ops.greedy_tokens(logits)  # the first maximum, as argmax
        else:
            tokens = self._sample(logits, reqs)
        token_list = tokens.tolist()
        out_logprobs: list[Logprobs | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            out_logprobs = self._gather_logprobs(raw_logprobs, tokens, token_list, params)
        return SamplerOutput(token_list, out_logprobs)

    @staticmethod
    def _mask_early_stop(logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens and r.stop_ids:
                logits[i, list(r.stop_ids)] = float("-inf")

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        u = torch.rand(len(reqs), generator=self.generator, device=dev, dtype=torch.float64)
        for i, r in enumerate(reqs):
            seed = r.params.seed
            if seed is not None and not r.params.greedy:
                u[i] = torch.rand((), generator=self._row_generator(r, seed), device=dev,
                                  dtype=torch.float64)
        sampled = sample(logits / temps.unsqueeze(1), params, u)
        if not any(p.greedy for p in params):
            return sampled
        return torch.where(greedy, ops.greedy_tokens(logits), sampled)

    def _row_generator(self, r: Request, seed: int) -> torch.Generator:
        gen = self.row_generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(device=self.generator.device)
            gen.manual_seed(seed + r.index)
            self.row_generators[r.request_id] = gen
        return gen

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                         params: list[SamplingParams]) -> list[Logprobs | None]:
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k = max(p.logprobs or 0 for p in params)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            vals, ids = raw.topk(k, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[Logprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            entry = {token_list[i]: chosen[i]}
            for j in range(p.logprobs):
                entry.setdefault(top_ids[i][j], top_vals[i][j])
            out.append(entry)
        return out


def add_prompt_logprobs(logits: torch.Tensor, prompt_rows: Sequence[tuple[Request, int]],
                        ) -> None:
    """Score prompt tokens: ``logits`` [rows, vocab] holds, for each ``(request, count)`` of
    ``prompt_rows`` in turn, the rows of its next ``count`` unscored prompt positions; position
    p's row scores prompt token p + 1. Appends to each ``Request.prompt_logprobs``: the token's
    logprob and rank, and the top-N (its ``prompt_logprobs``) with ranks 1..N."""
    targets = [t for r, n in prompt_rows
               for t in r.all_token_ids[len(r.prompt_logprobs) : len(r.prompt_logprobs) + n]]
    k = max(r.params.prompt_logprobs or 0 for r, _ in prompt_rows)
    chosen, ranks, vals, ids = [], [], [], []
    for lo in range(0, len(targets), PROMPT_ROWS_AT_ONCE):  # float32 temporaries stay small
        raw = torch.log_softmax(logits[lo : lo + PROMPT_ROWS_AT_ONCE].float(), dim=-1)
        target_t = torch.tensor(targets[lo : lo + PROMPT_ROWS_AT_ONCE], device=raw.device)
        lp = raw.gather(1, target_t.unsqueeze(1))
        chosen += lp.squeeze(1).tolist()
        ranks += ((raw > lp).sum(dim=-1) + 1).tolist()
        top = raw.topk(k, dim=-1)
        vals += top.values.tolist()
        ids += top.indices.tolist()
    row = 0
    for r, n in prompt_rows:
        num = r.params.prompt_logprobs or 0
        for i in range(row, row + n):
            entry = {targets[i]: Logprob(chosen[i], ranks[i])}
            for j in range(num):
                entry.setdefault(ids[i][j], Logprob(vals[i][j], j + 1))
            r.prompt_logprobs.append(entry)
        row += n


def sample_peak(logits: torch.Tensor) -> torch.Tensor:
    """The temporaries of a heavy sampling step for ``logits`` [rows, vocab]: float32 logprobs
    held while every row takes its top-p nucleus (a sort of the vocabulary where no C kernel
    runs), then min-p and the draw. For the KV budget's profiling forward; returns the ids."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)  # noqa: F841  (held to the end, as logprobs are)
    params = [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)] * len(logits)
    u = torch.rand(len(logits), device=logits.device, dtype=torch.float64)
    return sample(logits / 0.7, params, u)


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None],
                native: bool) -> None:
    """Forbid, in place, every token that would leave its row's grammar (logits [rows, vocab];
    rows without a grammar are untouched): one bitmask, one masking call (``native``: the C
    kernel, in the logits' dtype; else xgrammar's own)."""
    import xgrammar as xgr

    rows = [(i, s) for i, s in enumerate(states) if s is not None]
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[-1])
    for i, state in rows:
        state.matcher.fill_next_token_bitmask(bitmask, i)
    indices = [i for i, _ in rows]
    if native:
        ops.mask_logits(logits, bitmask, indices)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)

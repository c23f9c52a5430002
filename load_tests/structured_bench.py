"""Structured output's cost: one set of requests through the engine with half of them held to a
JSON schema, and with none, in one invocation.

Workload: ``--num-prompts`` random-id prompts of 32-256 tokens (``offline_throughput.py``'s
generator, request ``i`` the same whatever the count); every other request carries ``SCHEMA``
(an object with a bounded integer, a boolean and an array of 4-20 enum strings: outputs of
tens of tokens, each masked by its grammar), greedy, at most ``--max-tokens``. The mixed run
goes first; the free run then gives every request the number of tokens its twin produced in the
mixed run (``ignore_eos``), so both compute the same tokens; neither detokenizes (in serving the
Router does). Rounds alternate (``--rounds``);
one JSON line per run, then a summary with the median ratio of output tokens/s (mixed / free),
target at least 0.9, the share of the finished constrained outputs that validate against the
schema, and how many were cut by ``--max-tokens`` first (the tiny tokenizer spells words out).
Each run's line counts as ``failed`` the ``ignore_eos`` requests that did not produce exactly
their token count (the free ones of the mixed run ``--max-tokens``, every free-run request its
twin's); when any did, the script says which runs on stderr and exits 1 after the summary.

    .venv/bin/python load_tests/structured_bench.py --model-size tiny --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_throughput as ot  # noqa: E402  (after the path)

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 4,
             "maxItems": 20}},
    "required": ["id", "ok", "tags"], "additionalProperties": False}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=sorted(ot.MODEL_SHAPES), default="tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def mixed_params(n: int, max_tokens: int) -> list:
    from engine import SamplingParams, StructuredOutputsParams

    constrained = StructuredOutputsParams(json=SCHEMA)
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                           structured_outputs=constrained if i % 2 == 0 else None,
                           ignore_eos=i % 2 == 1) for i in range(n)]


def timed(llm, prompts: list[list[int]], params: list) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return time.perf_counter() - start, outs


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv=None) -> None:
    from engine import LLM, SamplingParams

    args = parse_args(argv)
    args.dtype = "auto"
    ot.resolve_cpu(args)  # args.cpu: the class and flags, for the JSON lines
    wl = ot.make_workload(args.num_prompts, args.seed, (32, 256), (1, 1))
    llm = LLM(model=str(ot.checkpoint_path(args.model_size)), max_model_len=1024)
    timed(llm, wl.prompts[:4], mixed_params(4, 16))  # warm-up: compiles the schema once
    rows, ratios, ok, cut = [], [], [], 0
    for r in range(args.rounds):
        elapsed, outs = timed(llm, wl.prompts, mixed_params(len(wl.prompts), args.max_tokens))
        lens = [len(o.outputs[0].token_ids) for o in outs]
        decode = llm.get_tokenizer().decode  # after the clock (the Router detokenizes, not
        ok += [valid(decode(o.outputs[0].token_ids, skip_special_tokens=True))  # the engine)
               for i, o in enumerate(outs)
               if i % 2 == 0 and o.outputs[0].finish_reason == "stop"]
        cut += sum(o.outputs[0].finish_reason == "length" for o in outs[::2])
        free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                for n in lens]
        free_elapsed, free_outs = timed(llm, wl.prompts, free)
        failed = {"mixed": sum(n != args.max_tokens for n in lens[1::2]),
                  "free": sum(len(o.outputs[0].token_ids) != n for o, n in zip(free_outs, lens))}
        for name, secs in (("mixed", elapsed), ("free", free_elapsed)):
            rows.append({"run": name, "round": r, "model": args.model_size,
                         "num_prompts": len(wl.prompts), "output_tokens": sum(lens),
                         "output_tok_s": round(sum(lens) / secs, 2), "failed": failed[name]})
            print(json.dumps(rows[-1]), flush=True)
        ratios.append(free_elapsed / elapsed)
    print(json.dumps({"summary": True, "model": args.model_size, "rounds": args.rounds,
                      "mixed_over_free_tok_s": round(statistics.median(ratios), 3),
                      "per_round": [round(x, 3) for x in ratios],
                      "constrained_valid": f"{sum(ok)}/{len(ok)}", "constrained_cut_by_max_tokens": cut,
                      "dtype": args.dtype,
                      "cpu": args.cpu}),
          flush=True)
    bad = [f"{row['run']} round {row['round']}: {row['failed']} of {row['num_prompts']}"
           for row in rows if row["failed"]]
    if bad:
        raise SystemExit("structured_bench: requests without their token count (ignore_eos): "
                         + "; ".join(bad))


if __name__ == "__main__":
    main()

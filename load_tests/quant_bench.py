"""Precision modes side by side: the same model and workload through the engine in its plain
dtype and with each quantization mode, and vLLM's CPU build in the plain dtype, in one
invocation.

For each engine variant: the bytes its weights take (linear layers as stored, prepacked or not,
with their scales; embedding, LM head and norms), the KV-cache blocks it gets from the same
memory, offline output tokens/s on ``offline_throughput.py``'s workload, and decode-only
tokens/s at batch 1, 8 and 64 (a batch of 16-token prompts generating ``--decode-tokens``
tokens, less the same batch's prefill and first token, with fresh prompt ids each time so the
prefix cache never answers). Variants (``MODES``): the plain dtype, ``quantization=int8``,
``quantization=fp8``, ``kv_cache_dtype=fp8`` and int8 with it. All variants' engines are held
at once and measured in turn, ``--rounds`` times with the order rotated, and each figure is
the median of its rounds (a 2-core machine's speed drifts by 20% over minutes); each engine
(and vLLM) gets a 1 GiB KV cache unless ``--kv-cache-gib`` says otherwise. One JSON line per
variant (and one for vLLM), then a summary line with each variant's ratios to the plain dtype,
and with ``--plot`` a bar chart of the ratios. Every request must produce exactly its
``max_tokens`` (``ignore_eos``); when one does not, the script names the variant, the round and
how many fell short on stderr and exits 1 (no summary: the ratios would compare unequal work).

    .venv/bin/python load_tests/quant_bench.py --model-size 0.5b --num-prompts 64 \\
        --vllm-python /tmp/vllm-venv/bin/python --plot

``--plot`` without a path redraws ``docs/perf/quant_bench.png`` (``quant_bench_<isa>.png`` with
``--isa``), the plots of ``docs/perf/quantization.md``; keep the JSON lines beside them in
``docs/perf/results/``.

The plain dtype is what ``dtype=auto`` takes on this CPU (bfloat16 only where it is native),
or ``--dtype``. ``--modes`` picks variants (the first is the baseline); ``--isa CLASS`` caps the
instruction set as ``offline_throughput.py`` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_throughput as ot  # noqa: E402  (after the path)
from perf_home import plot_path  # noqa: E402

# (name, quantization, kv_cache_dtype): the plain dtype first, the baseline of the ratios
MODES = {"plain": (None, "auto"), "int8": ("int8", "auto"), "fp8": ("fp8", "auto"),
         "fp8-kv": (None, "fp8"), "int8+fp8-kv": ("int8", "fp8")}
DECODE_BATCHES = (1, 8, 64)


def decode_tok_s(llm, batch: int, new_tokens: int, seed: int, context: int = 16,
                 repeats: int = 2) -> float:
    """Tokens/s of decode steps alone at ``batch`` sequences of ``context`` tokens: the same
    batch generating ``1 + new_tokens`` tokens less generating 1 (the prefill and first token),
    best of ``repeats``; fresh prompt ids every run, so the prefix cache never answers."""
    from engine import SamplingParams

    rng = random.Random(seed)
    vocab = min(1000, llm.engine.vocab_size)

    def run(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]}
                   for _ in range(batch)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                detokenize=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ot.check_lengths(f"decode at batch {batch}", [len(o.outputs[0].token_ids) for o in outs],
                         [max_tokens] * batch)
        return elapsed

    first = min(run(1) for _ in range(repeats))
    full = min(run(1 + new_tokens) for _ in range(repeats))
    return batch * new_tokens / max(full - first, 1e-9)


def open_engine(path: Path, args, mode: str) -> tuple[ot.EngineBackend, dict]:
    """An engine for ``mode`` and what it holds (weight bytes, KV blocks)."""
    from engine.executor.model_runner import weight_bytes

    args.quantization, args.kv_cache_dtype = MODES[mode]
    backend = ot.EngineBackend(path, args)
    llm = backend.llm
    return backend, {"variant": args.dtype if mode == "plain" else mode, "dtype": args.dtype,
                     "quantization": args.quantization,
                     "kv_cache_dtype": llm.engine.kv_cache_dtype,
                     "weight_bytes": weight_bytes(llm.engine.runner.model),
                     "kv_blocks": llm.engine.runner.num_blocks}


def run_engines(path: Path, wl: ot.Workload, args, modes: list[str], rounds: int) -> list[dict]:
    """Every variant's engine held at once and measured in turn, ``rounds`` times, each round
    starting one variant later (so a drift of the machine's speed falls on all of them); each
    figure is the median of its rounds."""
    engines = [open_engine(path, args, mode) for mode in modes]
    times: list[dict[str, list[float]]] = [{} for _ in modes]
    for r in range(rounds):
        for i in [(r + j) % len(modes) for j in range(len(modes))]:
            try:
                measure(engines[i][0], wl, args, r, times[i])
            except RuntimeError as exc:  # a request without its max_tokens: no figure
                raise SystemExit(f"quant_bench: {modes[i]} round {r}: {exc}") from exc
    runs = []
    for (backend, res), measured in zip(engines, times):
        res.update({k: round(statistics.median(v), 2) for k, v in measured.items()})
        res["rounds"] = rounds
        backend.close()
        runs.append(res)
    gc.collect()
    return runs


def measure(backend: ot.EngineBackend, wl: ot.Workload, args, r: int,
            times: dict[str, list[float]]) -> None:
    """One round of one variant: offline output tokens/s, then decode-only tokens/s."""
    elapsed, _ = backend.generate(wl)
    times.setdefault("output_tok_s", []).append(wl.output_tokens / elapsed)
    for b in DECODE_BATCHES:
        times.setdefault(f"decode_tok_s_b{b}", []).append(
            decode_tok_s(backend.llm, b, args.decode_tokens, seed=b * 31 + r))


def summary(runs: list[dict], vllm: dict | None) -> dict:
    base = runs[0]
    keys = ["weight_bytes", "kv_blocks", "output_tok_s",
            *(f"decode_tok_s_b{b}" for b in DECODE_BATCHES)]
    out: dict = {"summary": True, "baseline": base["variant"], "ratios": {}}
    for r in runs[1:]:
        out["ratios"][r["variant"]] = {k: round(r[k] / base[k], 3) for k in keys}
    if vllm is not None:
        out["vllm_output_tok_s"] = vllm["output_tok_s"]
        out["engine_vs_vllm_output"] = {r["variant"]: round(r["output_tok_s"] /
                                                            vllm["output_tok_s"], 3)
                                        for r in runs}
    return out


def plot(summ: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(summ["ratios"])
    keys = list(next(iter(summ["ratios"].values()))) if variants else []
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [summ["ratios"][v][k] for k in keys], width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(keys))], keys,
                  rotation=20, fontsize=8)
    ax.set_ylabel(f"ratio to {summ['baseline']}")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    own = argparse.ArgumentParser(add_help=False)  # the rest are offline_throughput.py's
    own.add_argument("--decode-tokens", type=int, default=32)
    own.add_argument("--plot", nargs="?", const="", default=None,
                     help="a bar chart of the ratios (PNG; no path: docs/perf/quant_bench.png, "
                     "quant_bench_<isa>.png with --isa)")
    own.add_argument("--rounds", type=int, default=2, help="measurements of each variant")
    own.add_argument("--modes", default=",".join(MODES),
                     help=f"engine variants, the first the baseline (of {', '.join(MODES)})")
    mine, rest = own.parse_known_args(argv)
    backends = "engine,vllm" if "--vllm-python" in rest else "engine"
    args = ot.parse_args(["--backends", backends, *rest])
    args.decode_tokens = mine.decode_tokens
    if not any(a.startswith("--kv-cache-gib") for a in rest):
        args.kv_cache_gib = 1  # every variant's engine is held at once
    png = mine.plot
    if png == "":  # --plot without a path: the page's plot
        png = plot_path(f"quant_bench_{args.isa}.png" if args.isa else "quant_bench.png")
    ot.apply_isa_cap(args.isa)
    ot.resolve_cpu(args)
    path = ot.checkpoint_path(args.model_size)
    wl = ot.make_workload(args.num_prompts, args.seed, tuple(args.prompt_len),
                          tuple(args.output_len))
    runs = [{**res, "model": args.model_size, "cpu": args.cpu, "num_prompts": args.num_prompts}
            for res in run_engines(path, wl, args, mine.modes.split(","), mine.rounds)]
    for res in runs:
        print(json.dumps(res), flush=True)
    vllm = None
    if "vllm" in args.backends:
        backend = ot.VLLMBackend(path, args)
        try:
            elapsed, _ = backend.generate(wl)
        except RuntimeError as exc:  # its log, with how many fell short, is above
            raise SystemExit(f"quant_bench: vllm: {exc}") from exc
        finally:
            backend.close()
        vllm = {"variant": f"vllm {args.dtype}", "model": args.model_size, "cpu": args.cpu,
                "output_tok_s": round(wl.output_tokens / elapsed, 2)}
        print(json.dumps(vllm), flush=True)
    summ = summary(runs, vllm)
    print(json.dumps(summ), flush=True)
    if png:
        plot(summ, png, f"{args.model_size}, {args.num_prompts} requests, "
             f"{args.cpu['class']}: ratios to {summ['baseline']}")


if __name__ == "__main__":
    main()

"""The sampler alone: milliseconds per step for a batch of logits rows, by sampling settings.

One JSON line per (rows, settings): the engine's ``Sampler`` on float32 logits of a Qwen2-sized
vocabulary (151,936), the median of ``--repeats`` calls, with the threads a user gets. The
settings are those ``offline_throughput.py --sampling`` names (a model's generation_config
defaults), plus min-p and a seeded row set. The end-to-end effect, beside vLLM, is
``offline_throughput.py --sampling qwen2.5``.

    python load_tests/sampling_bench.py --rows 8 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import DeviceConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sample.sampler import Sampler

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "seeded": {"temperature": 1.0, "seed": 7},
    "llama3": {"temperature": 0.6, "top_p": 0.9},
    "qwen2.5": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--context", type=int, default=1024, help="tokens each row has seen")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(DeviceConfig().cpu_threads())
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        # logits shaped like a model's: a few likely tokens over a long flat tail
        logits = torch.randn(rows, args.vocab, generator=gen) * 2.0
        context = torch.randint(0, args.vocab, (rows, args.context), generator=gen).tolist()
        for name, kwargs in SETTINGS.items():
            sampler = Sampler(0, torch.device("cpu"))
            reqs = [Request(f"r{i}", context[i], SamplingParams(**kwargs)) for i in range(rows)]
            times = []
            for _ in range(args.repeats):
                batch = logits.clone()  # the sampler may write into its logits
                start = time.perf_counter()
                sampler(batch, reqs)
                times.append(time.perf_counter() - start)
            print(json.dumps({"rows": rows, "vocab": args.vocab, "settings": name,
                              "ms": round(1e3 * statistics.median(times), 2),
                              "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()

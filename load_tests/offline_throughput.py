"""Offline throughput: one workload through pagedserve's engine, Hugging Face ``generate`` with
static batches and, given a Python that has vLLM's CPU build (``--vllm-python``), vLLM in a
subprocess.

Workload: ``--num-prompts`` requests (128), prompt lengths uniform in 32..512 random token ids,
output lengths uniform in 16..256, ``ignore_eos``, greedy (``--sampling``: what a model's
generation_config makes a request sample with, e.g. Qwen2.5-Instruct's temperature 0.7, top-p
0.8, top-k 20, repetition penalty 1.05; the same for every backend), fixed seed. Request ``i`` is the same
whatever ``--num-prompts`` is, so a smaller run is a prefix of the full one. The checkpoint is a
random-weight Qwen2 in bfloat16, built once into the cache folder: the Qwen2.5-0.5B shape
(``--model-size 0.5b``) or a tiny one for quick runs (``--model-size tiny``); or a small
mixture-of-experts Qwen3-MoE (``--model-size moe``: 16 experts, top-4); or the app's default
model (``--model-size default``: float32, a 768-token vocabulary; prompt ids below 700, as the
serving benchmarks send).

Prints one JSON line per backend run, then one with the ratios of the engine's output tokens/s to
the others'. Every request must produce exactly its output length (``ignore_eos``): a backend
run where one did not prints no line; the script names the backend, the round and how many
requests fell short on stderr and exits 1. Timing covers only the generate calls (model loading and a short warm-up excluded).
On a shared machine, ``--rounds N`` loads every backend once and alternates them N times; the
ratios are then medians of per-round ratios. ``--profile`` times the parts of the engine's step
(scheduling, batch preparation, model forward split by kernel, logits, sampling, the rest) and,
with ``--torch-profile-steps``, lists the top torch ops of one prefill and a few decode steps.

    python load_tests/offline_throughput.py --model-size tiny --backends engine,hf,vllm \\
        --vllm-python /tmp/vllm-venv/bin/python --profile --plot out.png

``--plot`` without a path redraws ``docs/perf/offline_throughput.png``; runs worth keeping go
to ``docs/perf/results/`` beside the page that cites them (``docs/perf/README.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load_tests.perf_home import plot_path  # noqa: E402

VOCAB = 151936
MODEL_SHAPES = {
    # Qwen2.5-0.5B: 494M parameters, tied embeddings, qkv bias.
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, initializer_range=0.02),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05),
    # Qwen3-30B-A3B's layout scaled down: 16 experts of 256, top-4 renormalised, q/k norms.
    "moe": dict(arch="qwen3_moe", hidden_size=512, intermediate_size=1024,
                moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, initializer_range=0.02),
}
# The tokenizer is the default model's (about 1,000 tokens): prompts are token ids, outputs are
# not detokenized, and the engine, HF and vLLM (0.32) all accept ids up to the model's vocab.
TOKENIZER_SKIP = {"config.json", "generation_config.json", "model.safetensors"}
RESULT_TAG = "OFFLINE_THROUGHPUT_RESULT "
CPU_CLASSES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # kernels/cpu_isa.py
# --sampling: SamplingParams fields (vLLM's names; Hugging Face's generate takes the same)
SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "llama3": {"temperature": 0.6, "top_p": 0.9},  # Llama-3.x-Instruct's generation_config
    "qwen2.5": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
}


# ----------------------------------------------------------------------------- workload
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])

    def with_fresh_ids(self, seed: int, vocab: int = VOCAB) -> Workload:
        """The same lengths with other random token ids: a later round must not find the
        earlier rounds' prompts in the prefix cache (both engines have one)."""
        rng = random.Random(seed)
        return Workload([[rng.randrange(vocab) for _ in p] for p in self.prompts],
                        self.output_lens)


def make_workload(num_prompts: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], vocab: int = VOCAB) -> Workload:
    """Request ``i`` depends only on ``seed`` and ``i`` (drawn one request at a time)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        plen = rng.randint(*prompt_range)
        outs.append(rng.randint(*output_range))
        prompts.append([rng.randrange(vocab) for _ in range(plen)])
    return Workload(prompts, outs)


WARMUP = make_workload(2, 1, (16, 32), (4, 4), 700)  # ids every model here takes


# ----------------------------------------------------------------------------- checkpoint
def checkpoint_path(size: str) -> Path:
    """The random checkpoint of ``size``, built on first use (config, bf16 safetensors,
    the default model's tokenizer files with the vocabulary padded to the model's)."""
    from engine.envs import cache_dir

    if size == "default":
        from engine.models.default_model import default_model_path
        return default_model_path()
    name = {"0.5b": "bench-qwen2-0.5b-shape-v2", "tiny": "bench-qwen2-tiny-v2",
            "moe": "bench-qwen3-moe-v2"}[size]
    path = cache_dir() / name
    if not (path / "config.json").is_file():
        _build_checkpoint(path, MODEL_SHAPES[size])
    return path


def _build_checkpoint(path: Path, shape: dict) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.models.default_model import default_model_path

    tok_dir = default_model_path()
    eos = json.loads((tok_dir / "config.json").read_text()).get("eos_token_id")
    shape = dict(shape)
    config_cls, model_cls = ((Qwen3MoeConfig, Qwen3MoeForCausalLM)
                             if shape.pop("arch", None) == "qwen3_moe"
                             else (Qwen2Config, Qwen2ForCausalLM))
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=eos,
                        architectures=[model_cls.__name__], **shape)
    print(f"building {path} ({shape})", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        torch.manual_seed(0)
        model = model_cls(config).to(torch.bfloat16)
        _check_finite_logits(model)
        model.save_pretrained(tmp)
        for f in tok_dir.iterdir():
            if f.is_file() and f.name not in TOKENIZER_SKIP:
                shutil.copy(f, tmp / f.name)
        _pad_vocab(tmp / "tokenizer.json", VOCAB)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pad_vocab(tokenizer_json: Path, size: int) -> None:
    """Give every id the model can sample a token that decodes to text (`` t<id>``), as a real
    checkpoint's tokenizer does: the default model's few hundred tokens would leave nearly every
    generated id without text, and a streaming server sends nothing for those."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
    for i in range(size):
        if i not in used and f"\u0120t{i}" not in vocab:
            vocab[f"\u0120t{i}"] = i
    tokenizer_json.write_text(json.dumps(tok, ensure_ascii=False))
    # without this, transformers gives a vocabulary this large an extra unk token past its end
    config_json = tokenizer_json.with_name("tokenizer_config.json")
    config = json.loads(config_json.read_text())
    config["unk_token"] = None
    config_json.write_text(json.dumps(config, indent=2))


def _check_finite_logits(model) -> None:
    import torch

    with torch.inference_mode():
        logits = model(torch.randint(0, VOCAB, (1, 64))).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("random checkpoint gives non-finite logits; lower initializer_range")


# ----------------------------------------------------------------------------- backends
def check_lengths(backend: str, got: list[int], want: list[int]) -> None:
    """Raise ``RuntimeError`` saying how many requests did not produce their output length."""
    bad = sum(g != w for g, w in zip(got, want))
    if bad or len(got) != len(want):
        raise RuntimeError(f"{backend}: {bad} of {len(want)} requests did not produce their "
                           f"max_tokens (ignore_eos); {len(got)} outputs")


def result(backend: str, model: str, wl: Workload, elapsed: float, **extra) -> dict:
    return {
        "backend": backend, "model": model, "num_prompts": len(wl.prompts),
        "prompt_tokens": wl.prompt_tokens, "output_tokens": wl.output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(wl.output_tokens / elapsed, 2),
        "total_tok_s": round((wl.prompt_tokens + wl.output_tokens) / elapsed, 2),
        "req_s": round(len(wl.prompts) / elapsed, 4), **extra,
    }


class EngineBackend:
    """pagedserve's offline ``LLM``, in this process."""

    name = "engine"

    def __init__(self, path: Path, args):
        from engine import LLM

        self.args = args
        self.llm = LLM(model=str(path), dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory_bytes=args.kv_cache_gib << 30,
                       num_threads=args.engine_threads,
                       quantization=args.quantization,
                       kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
        self._generate(WARMUP, use_tqdm=False)
        self.timers = StepTimers(self.llm.engine) if args.profile else None
        self.profiled_s = 0.0

    def _generate(self, wl: Workload, use_tqdm: bool) -> None:
        from engine import SamplingParams

        params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False,
                                 **SAMPLINGS[self.args.sampling]) for n in wl.output_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params,
                                 use_tqdm=use_tqdm)
        check_lengths("engine", [len(o.outputs[0].token_ids) for o in outs], wl.output_lens)

    def generate(self, wl: Workload) -> tuple[float, dict]:
        steps = self.llm.engine.num_steps
        start = time.perf_counter()
        self._generate(wl, use_tqdm=True)
        elapsed = time.perf_counter() - start
        self.profiled_s += elapsed
        return elapsed, {"steps": self.llm.engine.num_steps - steps}

    def close(self) -> None:
        if self.timers is not None:
            self.timers.restore()
            self.timers.report(self.profiled_s)
            if self.args.torch_profile_steps:
                torch_profile(self.llm, self.args.torch_profile_steps,
                              self.args.torch_profile_batch)
        del self.llm
        gc.collect()


class HFBackend:
    """Hugging Face ``generate`` with static batches, padded on the left, in this process."""

    name = "hf"

    def __init__(self, path: Path, args):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        self.args = args
        sampling = SAMPLINGS[args.sampling]
        self.sampling = {"do_sample": False} if sampling["temperature"] == 0 else {
            "do_sample": True, **sampling}
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, args.dtype)).eval()
        self._batch(WARMUP, [0, 1])

    def generate(self, wl: Workload) -> tuple[float, dict]:
        from tqdm.auto import tqdm

        order = list(range(len(wl.prompts)))
        if self.args.hf_sort:  # similar lengths together: less padding, a stronger baseline
            order.sort(key=lambda i: len(wl.prompts[i]) + wl.output_lens[i])
        bs = self.args.hf_batch_size
        batches = [order[i : i + bs] for i in range(0, len(order), bs)]
        start = time.perf_counter()
        for batch in tqdm(batches, desc="HF generate", unit="batch", dynamic_ncols=True):
            self._batch(wl, batch)
        return time.perf_counter() - start, {"batch_size": bs, "sorted": self.args.hf_sort}

    def _batch(self, wl: Workload, idx: list[int]) -> None:
        """One static batch; it runs to its longest output (``min_new_tokens`` keeps EOS from
        ending it early); only each request's own output length counts as output."""
        import torch

        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(wl.output_lens[i] for i in idx)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                      min_new_tokens=new, pad_token_id=0, **self.sampling)
        if out.shape[1] != width + new:
            raise RuntimeError(f"HF: a batch of {len(idx)} requests generated "
                               f"{out.shape[1] - width} tokens, expected {new}")

    def close(self) -> None:
        del self.model
        gc.collect()


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams

SAMPLING = {}

def generate(llm, prompts, lens, use_tqdm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **SAMPLING)
              for n in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)
    bad = sum(len(o.outputs[0].token_ids) != n for o, n in zip(outs, lens))
    if bad or len(outs) != len(lens):
        raise SystemExit(f"vLLM: {bad} of {len(lens)} requests did not produce their "
                         f"max_tokens (ignore_eos); {len(outs)} outputs")


def main():  # under __main__: vLLM spawns its engine-core process
    spec = json.load(open(sys.argv[1]))
    SAMPLING.update(spec["sampling"])
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0)
    generate(llm, spec["warmup"]["prompts"], spec["warmup"]["output_lens"], False)
    print(__TAG__ + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # one line per run: the path of a workload file
        wl = json.load(open(line.strip()))
        start = time.perf_counter()
        generate(llm, wl["prompts"], wl["output_lens"], True)
        print(__TAG__ + json.dumps({"elapsed_s": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
""".replace("__TAG__", repr(RESULT_TAG))


class VLLMBackend:
    """vLLM in a subprocess of ``--vllm-python``, kept alive across rounds; its log goes to
    our stderr. Each run sends it a workload file and reads back the generate call's time."""

    name = "vllm"

    def __init__(self, path: Path, args):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        env.pop("PYTHONPATH", None)
        self.tmp = tempfile.TemporaryDirectory(prefix="offline-throughput-")
        script, spec = Path(self.tmp.name, "run_vllm.py"), Path(self.tmp.name, "spec.json")
        script.write_text(VLLM_SCRIPT)
        spec.write_text(json.dumps({
            "model": str(path), "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "sampling": SAMPLINGS[args.sampling], "warmup": {"prompts": WARMUP.prompts, "output_lens": WARMUP.output_lens}}))
        self.proc = subprocess.Popen([args.vllm_python, str(script), str(spec)], env=env,
                                     cwd=self.tmp.name, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._read()  # ready

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG) :])
            sys.stderr.write(line)
        raise RuntimeError(f"vLLM subprocess failed (exit code {self.proc.wait()}); "
                           "its log is above")

    def generate(self, wl: Workload) -> tuple[float, dict]:
        path = Path(self.tmp.name, "workload.json")
        path.write_text(json.dumps({"prompts": wl.prompts, "output_lens": wl.output_lens}))
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return self._read()["elapsed_s"], {}

    def close(self) -> None:
        self.proc.stdin.close()
        for line in self.proc.stdout:
            sys.stderr.write(line)
        if self.proc.wait(timeout=120) != 0:
            print(f"vLLM subprocess exit code {self.proc.returncode}", file=sys.stderr)
        self.tmp.cleanup()


BACKENDS = {"engine": EngineBackend, "hf": HFBackend, "vllm": VLLMBackend}


# ----------------------------------------------------------------------------- profile
class StepTimers:
    """Wraps the engine's step parts with wall-clock timers. On the CPU the parts need no
    device sync; on CUDA pass ``sync`` (``torch.cuda.synchronize``), called as each top-level
    part ends, so a part's time includes its kernels (the step already waits for its tokens,
    so the syncs add little). ``decode_rows``: count only the decode steps of that many
    sequences (a batch's own size, not the tail of it left running).

    Parts: ``schedule`` (Scheduler.schedule), ``prepare`` (ModelRunner.prepare), ``forward``
    (the model's forward, eager or a CUDA graph's replay), ``logits`` (compute_logits),
    ``sample`` (the sampler), and ``other``:
    the rest of ``LLMEngine.step`` (finish_step, appending tokens, stop checks, outputs). The
    forward is split further by the kernel entry points in ``kernels.ops``, ``F.linear``,
    ``kernels.cpu_gemm.packed_linear`` and ``kernels.quant_linear``'s products
    (``fwd.rest``: embedding, splits, views, residual copies, module-call overhead). Steps are
    counted apart as decode-only steps and steps that carry a prefill chunk.
    """

    PARTS = ("schedule", "prepare", "forward", "logits", "sample")
    FWD_PARTS = {"linear": ("torch.nn.functional.linear", "kernels.cpu_gemm.packed_linear",
                            "kernels.quant_linear.int8_linear",
                            "kernels.quant_linear.int8_linear_ref"),
                 "attention": ("kernels.ops.paged_attention",),
                 "kv_store": ("kernels.ops.store_kv_cache",),
                 "norm": ("kernels.ops.rms_norm", "kernels.ops.fused_add_rms_norm"),
                 "rotary": ("kernels.ops.rotary_embedding",),
                 "silu_mul": ("kernels.ops.silu_and_mul",)}

    def __init__(self, engine, sync=None, decode_rows=None):
        import importlib

        self.sync = sync
        self.decode_rows = decode_rows  # count only decode steps of this many rows, if set
        self.rows_now = 0
        self.cur: dict[str, float] = defaultdict(float)
        self.totals = {k: defaultdict(float) for k in ("decode", "prefill")}
        self.counts = {"decode": 0, "prefill": 0}
        self.kind, self.in_forward = "decode", False
        self._saved = []
        sched, runner = engine.scheduler, engine.runner
        self._wrap_method(sched, "schedule", "schedule", classify=True)
        self._wrap_method(runner, "prepare", "prepare")
        self._wrap_method(runner, "_forward", "forward", forward=True)
        self._wrap_method(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sampler", _TimedSampler(runner.sampler, self))
        self._wrap(engine, "step", self._step(engine.step))
        for part, targets in self.FWD_PARTS.items():
            for target in targets:
                module, name = target.rsplit(".", 1)
                self._wrap_method(importlib.import_module(module), name, "fwd." + part,
                                  inner=True)

    def _wrap(self, obj, name: str, new) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, new)

    def _wrap_method(self, obj, name: str, part: str, **kw) -> None:
        """Time ``obj.name`` as ``part``; a part the engine no longer has stays at zero."""
        fn = getattr(obj, name, None)
        if fn is None:
            print(f"profile: {type(obj).__name__}.{name} not found; {part} not timed",
                  file=sys.stderr)
            return
        self._wrap(obj, name, self._timed(part, fn, **kw))

    def restore(self) -> None:
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved = []

    def add(self, part: str, seconds: float) -> None:
        self.cur[part] += seconds

    def _timed(self, part: str, fn, classify=False, forward=False, inner=False):
        def wrapper(*a, **kw):
            if inner and not self.in_forward:
                return fn(*a, **kw)
            self.in_forward |= forward
            t = time.perf_counter()
            try:
                out = fn(*a, **kw)
                if self.sync is not None and not inner:
                    self.sync()
            finally:
                self.add(part, time.perf_counter() - t)
                self.in_forward &= not forward
            if classify:
                self.kind = "decode" if all(n == 1 for _, n in out.scheduled) else "prefill"
                self.rows_now = len(out.scheduled)
            return out
        return wrapper

    def _step(self, step):
        def wrapper():
            self.cur = defaultdict(float)
            t = time.perf_counter()
            out = step()
            total = time.perf_counter() - t
            if self.decode_rows not in (None, self.rows_now) and self.kind == "decode":
                return out  # a decode step of another batch size: not counted
            acc = self.totals[self.kind]
            for part, sec in self.cur.items():
                acc[part] += sec
            acc["other"] += total - sum(self.cur[p] for p in self.PARTS)
            fwd_parts = sum(self.cur["fwd." + p] for p in self.FWD_PARTS)
            acc["fwd.rest"] += self.cur["forward"] - fwd_parts
            acc["step"] += total
            self.counts[self.kind] += 1
            return out
        return wrapper

    def decode_ms(self) -> dict[str, float]:
        """ms per decode-only step, by part."""
        n = self.counts["decode"]
        return {p: round(self.totals["decode"][p] / n * 1e3, 3) for p in self.rows()} if n else {}

    def rows(self) -> list[str]:
        fwd = [f"fwd.{p}" for p in (*self.FWD_PARTS, "rest")]
        return ["schedule", "prepare", "forward", *fwd, "logits", "sample", "other", "step"]

    def report(self, elapsed: float) -> None:
        total = {k: sum(t[k] for t in self.totals.values()) for k in self.rows()}
        if not total["step"]:
            return
        print(f"\nengine step profile: {sum(self.counts.values())} steps "
              f"({self.counts['decode']} decode-only, {self.counts['prefill']} with prefill), "
              f"{total['step']:.1f} s in step() of {elapsed:.1f} s generate()", file=sys.stderr)
        print(f"  {'part':<14}{'all s':>9}{'share':>8}{'decode ms/step':>16}"
              f"{'prefill ms/step':>17}", file=sys.stderr)
        for part in self.rows():
            cells = [f"{self.totals[k][part] / self.counts[k] * 1e3:.2f}" if self.counts[k]
                     else "-" for k in ("decode", "prefill")]
            name = "  " + part[4:] if part.startswith("fwd.") else part
            print(f"  {name:<14}{total[part]:>9.2f}{total[part] / total['step']:>8.1%}"
                  f"{cells[0]:>16}{cells[1]:>17}", file=sys.stderr)
        if elapsed > 0:  # zero when a run was interrupted
            outside = elapsed - total["step"]
            print(f"  outside step() (LLM._run loop, tqdm, request intake): {outside:.2f} s "
                  f"({outside / elapsed:.1%} of generate)", file=sys.stderr)
        shares = {p: round(total[p] / total["step"], 4) for p in self.rows()[:-1]}
        print(json.dumps({"engine_step_profile": shares, "steps": self.counts}))


class _TimedSampler:
    def __init__(self, sampler, timers: StepTimers):
        self._sampler, self._timers = sampler, timers

    def __call__(self, logits, *args, **kwargs):
        t = time.perf_counter()
        out = self._sampler(logits, *args, **kwargs)
        if self._timers.sync is not None:
            self._timers.sync()
        self._timers.add("sample", time.perf_counter() - t)
        return out

    def __getattr__(self, name):
        return getattr(self._sampler, name)


_MISSING = object()


def torch_profile(llm, num_steps: int, batch: int = 64) -> None:
    """Top torch ops (self CPU time) of the first prefill step (a full token budget of
    256-token prompts) and of ``num_steps`` decode steps of ``batch`` requests."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    eng = llm.engine
    wl = make_workload(batch, 7, (256, 256), (1, 1))
    sp = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True,
                        detokenize=False)
    for i, p in enumerate(wl.prompts):
        eng.add_request(f"torch-profile-{i}", {"prompt_token_ids": p}, sp)
    with profile(activities=[ProfilerActivity.CPU]) as prefill:
        eng.step()
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running) \
            or eng.scheduler.waiting:
        eng.step()  # the rest of the prefill
    with profile(activities=[ProfilerActivity.CPU]) as decode:
        for _ in range(num_steps):
            eng.step()
    for i in range(batch):
        eng.abort(f"torch-profile-{i}")
    budget = eng.scheduler.max_num_batched_tokens
    for title, prof in ((f"1 prefill step of {budget} tokens", prefill),
                        (f"{num_steps} decode steps of {batch} requests at context ~260",
                         decode)):
        print(f"\ntorch ops, {title}:", file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
              file=sys.stderr)


# ----------------------------------------------------------------------------- main
def summary(runs: dict[str, list[dict]]) -> dict:
    """Ratios of the engine's output tokens/s to each other backend's: the median over rounds
    of the ratio within each round (a round's runs are minutes apart, so load drifts less)."""
    out: dict = {"ratios": {}}
    for other in ("hf", "vllm"):
        if runs.get("engine") and runs.get(other):
            per_round = [e["output_tok_s"] / o["output_tok_s"]
                         for e, o in zip(runs["engine"], runs[other])]
            out["ratios"][f"engine/{other}_output_tok_s"] = round(statistics.median(per_round), 3)
    if max(len(r) for r in runs.values()) > 1:
        out["median_output_tok_s"] = {name: statistics.median(x["output_tok_s"] for x in r)
                                      for name, r in runs.items()}
    return out


def plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    values = [statistics.median(x["output_tok_s"] for x in runs[n]) for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(names, values, color=["#3b75af", "#ef8636", "#519e3e"][: len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    ax.margins(y=0.12)  # room for the bar labels
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", choices=[*sorted(MODEL_SHAPES), "default"], default="0.5b")
    p.add_argument("--backends", default="engine,hf,vllm",
                   help="comma-separated, run in this order (engine, hf, vllm)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="run HF on only the first N requests (it is slow); default: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every backend this many times, alternating, each round with fresh "
                   "token ids (same lengths); ratios are medians of per-round ratios")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for every backend (default: the engine's own default, the "
                   "cores this process may use; HF and vLLM get the same count)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-sort", action="store_true",
                   help="batch HF requests of similar length together (default: arrival order)")
    p.add_argument("--vllm-python", default=None,
                   help="a Python with vLLM's CPU build (required for the vllm backend)")
    p.add_argument("--profile", action="store_true", help="time the engine's step parts")
    p.add_argument("--torch-profile-steps", type=int, default=0,
                   help="with --profile: also list top torch ops over N decode steps")
    p.add_argument("--torch-profile-batch", type=int, default=64,
                   help="requests (256-token prompts) in the torch-profiled decode steps")
    p.add_argument("--plot", nargs="?", const=plot_path("offline_throughput.png"), default=None,
                   help="write a bar chart of output tokens/s here (no path: "
                   "docs/perf/offline_throughput.png)")
    p.add_argument("--quantization", choices=("int8", "fp8"), default=None,
                   help="the engine's linear weights (vLLM and HF run unquantized)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="what the engine's KV cache holds (vLLM and HF: their default)")
    p.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy",
                   help="every backend's sampling settings (not greedy: the tokens differ "
                   "between backends, the work does not)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="activations' dtype for every backend; auto: what the engine's "
                   "dtype=auto picks for the bf16 checkpoint on this (capped) CPU")
    p.add_argument("--isa", choices=CPU_CLASSES, default=None,
                   help="run every backend as on a CPU of this class at most (oneDNN, MKL, "
                   "ATen and the C kernels capped; vLLM's own kernels are not): the script "
                   "restarts itself with the caps in its environment")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"engine", "hf", "vllm"}
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; accepted: engine, hf, vllm")
    if "vllm" in args.backends and not args.vllm_python:
        p.error("the vllm backend needs --vllm-python PATH")
    # the engine runs with what a user gets unless --threads is given; the others get its count
    args.engine_threads = args.threads
    args.threads = args.threads or len(os.sched_getaffinity(0))
    return args


def prompt_vocab(args) -> int:
    """Prompt ids are drawn below this: the default model's vocabulary is 768 tokens."""
    return 700 if args.model_size == "default" else VOCAB


def run_rounds(backends: list, wl: Workload, args) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {b.name: [] for b in backends}
    for r in range(args.rounds):
        round_wl = wl.with_fresh_ids(args.seed * 1_000_003 + r, prompt_vocab(args)) if r else wl
        for b in backends:
            work = round_wl
            if b.name == "hf" and args.hf_num_prompts:
                work = round_wl.head(args.hf_num_prompts)
            load = os.getloadavg()[0]
            try:
                elapsed, extra = b.generate(work)
            except RuntimeError as exc:  # a request without its output length: no figure
                raise SystemExit(f"offline_throughput: {b.name} round {r}: {exc}") from exc
            res = result(b.name, args.model_size, work, elapsed, **extra,
                         load_avg_1m_before=round(load, 2), dtype=args.dtype,
                         sampling=args.sampling, cpu=args.cpu, threads=args.threads)
            if args.rounds > 1:
                res["round"] = r
            runs[b.name].append(res)
            print(json.dumps(res), flush=True)
    return runs


def apply_isa_cap(isa: str | None) -> None:
    """Restart this script with the libraries' caps for ``isa`` in its environment (they are read
    once, at start-up, so setting them later would not take)."""
    from kernels.cpu_isa import isa_env

    if isa is None:
        return
    env = isa_env(isa)
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def resolve_cpu(args) -> None:
    """``args.dtype``: ``auto`` resolved as the engine resolves it; ``args.cpu``: the class and
    flags every JSON line carries, so each figure says which machine class it is from."""
    import torch

    from engine import envs
    from engine.loader import resolve_dtype
    from kernels import cpu_isa

    if args.dtype == "auto":
        args.dtype = str(resolve_dtype("auto", "bfloat16", torch.device("cpu"))).split(".")[1]
    flags = cpu_isa.cpu_flags()
    args.cpu = {"class": cpu_isa.isa_class(cap=envs.settings().cpu_isa),
                "machine_class": cpu_isa.detect(flags),
                "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))}


def main(argv=None) -> None:
    args = parse_args(argv)
    apply_isa_cap(args.isa)
    resolve_cpu(args)
    path = checkpoint_path(args.model_size)
    wl = make_workload(args.num_prompts, args.seed, tuple(args.prompt_len),
                       tuple(args.output_len), prompt_vocab(args))
    backends = []
    try:
        for name in args.backends:  # all loaded first, so that rounds can alternate them
            backends.append(BACKENDS[name](path, args))
        runs = run_rounds(backends, wl, args)
    finally:
        for b in reversed(backends):
            try:
                b.close()
            except Exception as e:  # close the others all the same
                print(f"closing {b.name}: {e!r}", file=sys.stderr)
    print(json.dumps(summary(runs)), flush=True)
    if args.plot:
        rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
        hf = (f" (hf: first {args.hf_num_prompts})"
              if args.hf_num_prompts and "hf" in runs else "")
        plot(runs, args.plot, f"{args.model_size}, {args.num_prompts} requests{hf}, "
             f"{args.threads} threads{rounds}")


if __name__ == "__main__":
    main()

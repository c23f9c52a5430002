"""The offline benchmarks (offline_throughput.py, quant_bench.py, structured_bench.py) refuse a
run whose requests did not all produce their ``max_tokens`` under ``ignore_eos``: they name the
run and how many fell short and exit nonzero. A fake ``LLM`` that stops one token early stands
in for the engine."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "load_tests"))

import offline_throughput as ot  # noqa: E402
import quant_bench  # noqa: E402
import structured_bench  # noqa: E402


class ShortLLM:
    """Answers every request with ``max_tokens`` tokens, less one under ``ignore_eos`` when
    ``short``: the count a benchmark must not believe."""

    def __init__(self, short: bool) -> None:
        self.short = short
        self.engine = SimpleNamespace(num_steps=0, vocab_size=1000)

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=[7] * (p.max_tokens - (self.short and p.ignore_eos)),
            finish_reason="length")]) for p in params]

    def get_tokenizer(self):
        return SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "{}")


def _engine_backend(short: bool) -> ot.EngineBackend:
    backend = ot.EngineBackend.__new__(ot.EngineBackend)  # no model: the fake LLM
    backend.args, backend.llm, backend.profiled_s = SimpleNamespace(sampling="greedy"), \
        ShortLLM(short), 0.0
    return backend


def test_offline_throughput_names_the_run_and_how_many_fell_short(capsys):
    wl = ot.make_workload(3, 0, (4, 8), (2, 5), vocab=700)
    args = SimpleNamespace(rounds=1, seed=0, hf_num_prompts=None, model_size="tiny",
                           dtype="float32", sampling="greedy", cpu={}, threads=1)
    runs = ot.run_rounds([_engine_backend(short=False)], wl, args)
    assert runs["engine"][0]["output_tokens"] == wl.output_tokens
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ot.run_rounds([_engine_backend(short=True)], wl, args)
    assert exc.value.code == ("offline_throughput: engine round 0: engine: 3 of 3 requests did "
                              "not produce their max_tokens (ignore_eos); 3 outputs")
    assert capsys.readouterr().out == ""  # no figure printed for it


def test_quant_bench_checks_the_decode_runs(monkeypatch):
    wl = ot.make_workload(2, 0, (4, 8), (2, 5), vocab=700)
    args = SimpleNamespace(decode_tokens=4)
    for short in (False, True):
        monkeypatch.setattr(quant_bench, "open_engine",
                            lambda path, args, mode, short=short: (_engine_backend(short), {}))
        if short:
            with pytest.raises(SystemExit) as exc:
                quant_bench.run_engines(Path("unused"), wl, args, ["plain"], rounds=1)
            assert str(exc.value.code).startswith("quant_bench: plain round 0: engine: 2 of 2")
        else:
            monkeypatch.setattr(ot.EngineBackend, "close", lambda self: None)
            (run,) = quant_bench.run_engines(Path("unused"), wl, args, ["plain"], rounds=1)
            assert run["rounds"] == 1 and run["decode_tok_s_b64"] > 0
    llm = ShortLLM(short=True)
    with pytest.raises(RuntimeError, match="decode at batch 8: 8 of 8 requests"):
        quant_bench.decode_tok_s(llm, 8, 4, seed=0, repeats=1)


def test_structured_bench_counts_short_free_requests(monkeypatch, capsys):
    import engine

    monkeypatch.setattr(ot, "resolve_cpu", lambda args: setattr(args, "cpu", {}))
    monkeypatch.setattr(ot, "checkpoint_path", lambda size: Path("unused"))
    argv = ["--num-prompts", "4", "--rounds", "1", "--max-tokens", "6"]
    monkeypatch.setattr(engine, "LLM", lambda **kw: ShortLLM(short=False))
    structured_bench.main(argv)
    assert '"failed": 0' in capsys.readouterr().out
    monkeypatch.setattr(engine, "LLM", lambda **kw: ShortLLM(short=True))
    with pytest.raises(SystemExit) as exc:
        structured_bench.main(argv)
    assert exc.value.code == ("structured_bench: requests without their token count (ignore_eos)"
                              ": mixed round 0: 2 of 4; free round 0: 4 of 4")

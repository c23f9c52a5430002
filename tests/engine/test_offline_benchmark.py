"""The offline benchmark script (load_tests/offline_throughput.py): its checkpoints' tokenizer and
its --profile path, run as a developer runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from engine.models.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "load_tests"))

import offline_throughput  # noqa: E402


def test_padded_vocab_gives_every_id_text_and_keeps_the_rest(tmp_path):
    src = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    before = AutoTokenizer.from_pretrained(src)
    offline_throughput._pad_vocab(tmp_path / "tokenizer.json", 2000)
    after = AutoTokenizer.from_pretrained(tmp_path)

    assert len(after) == 2000  # no token past the model's vocabulary
    assert after.decode([1500, 1999]) == " t1500 t1999"
    text = "Continuous batching, please"
    assert after.encode(text) == before.encode(text)
    assert after.eos_token_id == before.eos_token_id


def test_profile_run_reports_the_step_parts():
    """--profile wraps the engine's sampler and step: a signature change there broke it once."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "offline_throughput.py"), "--backends",
         "engine", "--model-size", "tiny", "--num-prompts", "3", "--prompt-len", "16", "40",
         "--output-len", "4", "9", "--kv-cache-gib", "1", "--profile"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    run = next(x for x in lines if x.get("backend") == "engine")
    wl = offline_throughput.make_workload(3, 0, (16, 40), (4, 9))
    assert run["output_tokens"] == wl.output_tokens
    assert run["cpu"]["class"] and run["threads"] >= 1
    parts = next(x for x in lines if "engine_step_profile" in x)["engine_step_profile"]
    top = {k: v for k, v in parts.items() if not k.startswith("fwd.")}
    assert set(top) == {"schedule", "prepare", "forward", "logits", "sample", "other"}
    assert abs(sum(top.values()) - 1.0) < 0.01
    assert parts["sample"] > 0 and parts["logits"] > 0 and parts["fwd.linear"] > 0

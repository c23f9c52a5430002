"""Helpers for the serving tests: a tiny checkpoint and one local Ray cluster."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_tiny_checkpoint(path: Path) -> Path:
    """A random float32 Llama (hidden 64, 2 layers) with the default model's tokenizer.

    ``initializer_range=0.2`` makes the greedy tokens depend on the context."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.default_model import default_model_path

    src = Path(default_model_path())
    base = LlamaConfig.from_pretrained(src)
    config = LlamaConfig(vocab_size=base.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
                         bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                         pad_token_id=base.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                         "special_tokens_map.json",
                                                         "generation_config.json"):
            shutil.copy(f, path / f.name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_ray(num_cpus: int = 8, **init_kwargs):
    """One local Ray cluster on 127.0.0.1 with Serve's HTTP proxy on a free port
    (``init_kwargs`` go to ``ray.init``)."""
    import ray
    from ray import serve

    from serve_app.cluster.ingress import prepare_cluster_env

    prepare_cluster_env()  # what build_app does before `serve run` starts Ray: same ingress
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    ray.init(address="local", num_cpus=num_cpus, _temp_dir=temp_dir, include_dashboard=False,
             log_to_driver=False, **init_kwargs)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_until(check, timeout_s: float, what: str, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s}s (last: {last!r})")

"""Checkpoint loading: safetensors, one file or sharded (``model.safetensors.index.json``).

Every checkpoint tensor is handed to the ``weight_loader`` of the parameter it feeds as a
``TensorSlice``, still on disk: the loader reads only this rank's shard of it, so a
tensor-parallel rank never materialises a full weight. Nothing from the checkpoint folder is ever
executed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from engine import envs

logger = logging.getLogger(__name__)

_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class TensorSlice:
    """A checkpoint tensor left in its safetensors file. ``narrow`` reads only the part asked
    for; ``read`` reads it whole. Shaped like the tensor (``shape``, ``dim()``)."""

    def __init__(self, handle: safe_open, name: str):
        self._slice = handle.get_slice(name)  # type: ignore[no-untyped-call]  # unannotated stub
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part: torch.Tensor = self._slice[(slice(None),) * dim + (slice(start, start + length),)]
        return part

    def read(self) -> torch.Tensor:
        whole: torch.Tensor = self._slice[:]
        return whole


Loaded = torch.Tensor | TensorSlice
# Which part of a packed parameter a checkpoint tensor is: "q"/"k"/"v", a gate/up index, or None.
ShardId = str | int | None
# A parameter's ``weight_loader(param, loaded, shard_id)``: copies its part of ``loaded`` in.
WeightLoader = Callable[[nn.Parameter, Loaded, ShardId], None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach the loader that fills ``param`` (a plain attribute, read by ``load_weights``)."""
    param.weight_loader = loader  # type: ignore[attr-defined]  # an attribute torch does not declare


def as_tensor(loaded: Loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


def copy_checked(param: torch.Tensor, part: Loaded, name: str) -> None:
    """Copy ``part`` into ``param``; ``ValueError`` naming ``name`` when their shapes differ."""
    if param.shape != part.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, checkpoint gives "
                         f"{tuple(part.shape)}")
    param.data.copy_(as_tensor(part))


def shard(loaded: Loaded, dim: int, index: int, num_shards: int, size: int,
          what: str = "weight") -> torch.Tensor:
    """Part ``index`` of ``num_shards`` equal parts of ``loaded`` along ``dim``, each ``size``
    long; ``ValueError`` when the checkpoint's extent along ``dim`` is not ``size * num_shards``."""
    if loaded.shape[dim] != size * num_shards:
        expected = (*loaded.shape[:dim], size * num_shards, *loaded.shape[dim + 1:])
        raise ValueError(f"{what}: expected shape {expected}, checkpoint gives "
                         f"{tuple(loaded.shape)}")
    return loaded.narrow(dim, index * size, size)


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for ext in _PICKLED for p in folder.glob(f"*{ext}"))
        found = (f"; found {', '.join(pickled[:4])}: pickled PyTorch weights, which are never "
                 "loaded (unpickling can run code). Convert them to safetensors") if pickled else ""
        raise ValueError(f"{folder}: no *.safetensors files (only safetensors checkpoints "
                         f"load){found}")
    return files


def _target(name: str, packed: dict[str, tuple[str, ShardId]]) -> tuple[str, ShardId]:
    for part, (packed_name, shard_id) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed_name}."), shard_id
    return name, None


def load_weights(model: nn.Module, folder: str | Path, progress: bool = True) -> None:
    """Fill ``model``'s parameters from the checkpoint; raise ``ValueError`` naming any missing
    tensor, unknown packed target or shape mismatch."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, ShardId]] = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    files = safetensors_files(folder)
    bar = tqdm(total=len(files), desc="Loading weights", unit="file", disable=not progress)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type on a corrupt header
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                target, shard_id = _target(name, packed)
                param = params.get(target)
                if param is None:
                    continue  # tensors the architecture does not use
                loader: WeightLoader | None = getattr(param, "weight_loader", None)
                try:
                    if loader is None:
                        default_weight_loader(param, f.get_tensor(name))
                    else:
                        loader(param, TensorSlice(f, name), shard_id)
                except ValueError as e:
                    raise ValueError(f"{path.name}: tensor {name}: {e}") from None
                loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        bar.update(1)
    bar.close()
    _check_complete(model, params, packed, loaded)


def default_weight_loader(param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
    """For unsharded parameters (norm weights): copy the whole tensor."""
    if param.shape != loaded.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint gives "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(as_tensor(loaded))


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter],
                    packed: dict[str, tuple[str, ShardId]], loaded: set[str]) -> None:
    expected: set[str] = set()
    for name in params:
        shard_ids = [sid for part, (pname, sid) in packed.items() if f".{pname}." in name]
        expected.update(f"{name}#{sid}" for sid in shard_ids) if shard_ids else expected.add(name)
    if getattr(getattr(model, "cfg", None), "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(m.replace("#", " part ") for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing tensors: {shown}{more}")


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device,
                  native_bf16: bool | None = None) -> torch.dtype:
    """The activations' dtype. ``auto`` on a CPU is the fastest the CPU has for the checkpoint:
    bfloat16 (for bfloat16 and float16 checkpoints) only where it is native (AVX512-BF16 or AMX;
    ``native_bf16``, default: probed), else float32, which on such CPUs runs ~3x faster than
    emulated bfloat16. On a GPU, ``auto`` is the checkpoint's dtype."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    on_cpu = device.type == "cpu"
    if on_cpu and native_bf16 is None:
        from kernels import settings as kernel_settings

        native_bf16 = kernel_settings.native_bf16(
            kernel_settings.isa_class(cap=envs.settings().cpu_isa))
    if name != "auto":
        if on_cpu and name in ("bfloat16", "float16") and not native_bf16:
            logger.warning("dtype=%s on a CPU without native bfloat16 (AVX512-BF16 or AMX): its "
                           "arithmetic is emulated, about 3x slower than float32 here; "
                           "dtype=auto (or float32) is faster", name)
        return table[name]
    dtype = table.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
    if on_cpu and dtype in (torch.float16, torch.bfloat16):
        # fp16 matmuls are slow on CPUs; bf16 only where the CPU has it natively
        return torch.bfloat16 if native_bf16 else torch.float32
    return dtype

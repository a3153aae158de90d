"""Loading a model that every rank should not hold whole.

At world size W a family that can (`Family.load_empty`) builds its trainable module on the meta
device; the train stack shards it with FSDP2 (`fully_shard` works on meta parameters), allocates
only this rank's shards (`to_empty`), and `fill` copies into each shard exactly its rows, read
straight from the checkpoint's safetensors files (`get_slice` reads those rows, nothing else).
No rank ever holds a full copy, so a host holds about one copy of the weights whatever W is
(benchmarks/load_memory.py measures it).

LoRA adapters do not exist in any checkpoint: `lora_init` draws them (peft's default: lora_A
uniform in +-1/sqrt(fan_in), lora_B zero) from a generator seeded by the run seed and the
parameter's name, the same full tensor on every rank and at every world size, so a sharded and a
whole load start from the same adapters.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from unirl.stages.runtime.seeds import derive_seed

PEFT_PREFIX = "base_model.model."


def is_empty(module: torch.nn.Module) -> bool:
    """Whether `module` was built on the meta device (its weights still to be filled)."""
    return any(p.is_meta for p in module.parameters())


def checkpoint_key(name: str) -> str:
    """The checkpoint's key of parameter `name` (peft's wrapper and base_layer names removed)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_value(name: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Adapter `name`'s initial value: lora_A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (peft's
    kaiming-uniform with a=sqrt(5)), lora_B = 0; seeded by (seed, name)."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(derive_seed(seed, "lora-init", name) % (2**63))
    bound = 1.0 / math.sqrt(shape[1]) if len(shape) > 1 else 1.0
    return ((torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound).to(dtype)


@torch.no_grad()
def lora_init(module: torch.nn.Module, seed: int) -> int:
    """Draw every (non-meta, unsharded) adapter of `module` with `lora_value`; returns how many."""
    count = 0
    for name, p in module.named_parameters():
        if is_adapter(name):
            p.copy_(lora_value(name, p.shape, p.dtype, seed))
            count += 1
    return count


def _rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor this rank writes, first global row it holds). FSDP2 shards dim 0 in chunks of
    ceil(n / W); the last ranks may hold fewer rows or none."""
    from torch.distributed.tensor import DTensor, Shard  # start-up time: torch loads on first use, not when a recipe is read

    if not isinstance(param, DTensor):
        return param, 0
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"sharded load: expected parameters sharded on dim 0, got {param.placements}")
    mesh = param.device_mesh
    chunk = math.ceil(param.shape[0] / mesh.size()) if param.dim() else 0
    return param.to_local(), chunk * mesh.get_local_rank()


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsRows:
    """Row ranges of the tensors in one safetensors file, read with plain positioned reads into
    the destination (no memory map: a rank's RSS holds its shards, not the file's pages)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb")  # noqa: SIM115 - closed by close()
        size = int.from_bytes(self.file.read(8), "little")
        header = json.loads(self.file.read(size))
        header.pop("__metadata__", None)
        self.base, self.entries = 8 + size, header

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def read_rows(self, key: str, rows: slice, out: torch.Tensor) -> None:
        """Rows `rows` of tensor `key` into `out` (converted to its dtype and device)."""
        entry = self.entries[key]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {key} has dtype {entry['dtype']}, which the sharded load cannot read")
        shape = entry["shape"]
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size() if shape else 0
        first, stop = (rows.start or 0, rows.stop) if shape else (0, 1)
        length = (stop - first) * row_bytes if shape else entry["data_offsets"][1] - entry["data_offsets"][0]
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(out.shape, dtype=dtype)
        if target.numel() * target.element_size() != length:
            raise ValueError(f"{self.path}: {key} rows {first}:{stop} are {length} bytes, the shard needs "
                             f"{target.numel() * target.element_size()}")
        self.file.seek(self.base + entry["data_offsets"][0] + first * row_bytes)
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        if self.file.readinto(view) != length:
            raise ValueError(f"{self.path}: {key} is cut short (the file is truncated)")
        if not direct:
            out.copy_(target)

    def close(self) -> None:
        self.file.close()


@torch.no_grad()
def fill(module: torch.nn.Module, device: torch.device, files: Iterable[Path], *, seed: int) -> None:
    """Allocate this rank's shards of the meta-built, sharded `module` on `device` and fill them
    from the safetensors `files` (adapters from `lora_value`). A weight the files lack, or a
    shape that differs, fails naming it."""
    kept = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}  # computed, not stored
    module.to_empty(device=device)
    for name, value in kept.items():
        module.get_buffer(name).copy_(value)
    wanted: dict[str, list[torch.Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if is_adapter(name):
            local, start = _rows(p)
            if local.numel():
                local.copy_(lora_value(name, p.shape, p.dtype, seed)[start:start + local.shape[0]] if local.dim()
                            else lora_value(name, p.shape, p.dtype, seed))
        else:
            wanted.setdefault(checkpoint_key(name), []).append(p)
    for name, b in module.named_buffers():
        if name not in kept:
            wanted.setdefault(checkpoint_key(name), []).append(b)
    found: set[str] = set()
    paths = [Path(f) for f in files]
    for path in paths:
        reader = SafetensorsRows(path)
        try:
            for key in reader.keys():
                for target in wanted.get(key, []):
                    if reader.shape(key) != tuple(target.shape):
                        raise ValueError(f"{path}: {key} has shape {reader.shape(key)}, the model expects {tuple(target.shape)}")
                    local, start = _rows(target)
                    if local.numel():
                        reader.read_rows(key, slice(start, start + local.shape[0]) if local.dim() else slice(None), local)
                    found.add(key)
        finally:
            reader.close()
    tied = {checkpoint_key(n) for n, _ in module.named_parameters(remove_duplicate=False)} - {
        checkpoint_key(n) for n, _ in module.named_parameters()}
    missing = sorted(set(wanted) - found - tied)
    if missing:
        where = ", ".join(str(p) for p in paths) or "(no safetensors files)"
        raise ValueError(f"sharded load: {len(missing)} weights are not in {where}: {', '.join(missing[:5])}"
                         " (set train.sharded_load: false to load the model whole)")

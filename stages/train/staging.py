"""Weights staged for an engine on this host, the fast path of a weight sync
(`rollout.engine.sync.transport: shm`): the trainer's rank 0 writes the tensors an engine loads
into a folder in shared memory (/dev/shm), in buckets of safetensors files with the index
Hugging Face loaders read (`model-00001-of-0000N.safetensors`, `model.safetensors.index.json`),
and the engine loads that folder as it would a published one. No disk, no hashing, no manifest on
this path: every load is verified by the canary instead (stages/runtime/canary.py).

A version is written over the previous one in place when the layout is the same (the same names,
shapes and dtypes: every version after the first): overwriting tmpfs pages that exist costs about
half of allocating new ones (0.38 against 0.78 s for 1.8 GB on one core, measured in
benchmarks/README.md), which is why the files are written here rather than through
safetensors.torch.save_file, whose result is the same format. Adapters (a few MB) are written to a
new file and moved over the old one.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of `tensors` (sorted) cut into runs of at most `bucket_bytes` each (a tensor larger
    than that is a bucket of its own)."""
    out: list[list[str]] = []
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if not out or (size + n > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def _header(tensors: dict[str, torch.Tensor], names: list[str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"staging weights: {name} has dtype {t.dtype}, which safetensors files here do not carry "
                             f"({', '.join(str(d) for d in DTYPES)})")
        end = offset + t.nbytes
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], names: list[str], *, in_place: bool = True) -> int:
    """`names` of `tensors` as one safetensors file at `path`; its bytes. `in_place`: an existing
    file is overwritten in place (its pages reused), else a new file replaces it atomically."""
    header = _header(tensors, names)
    target = path if in_place and path.exists() else path.with_name(path.name + ".tmp")
    with open(target, "r+b" if target.exists() else "wb", buffering=0) as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for name in names:
            t = tensors[name].detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.numel():
                fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        size = fh.tell()
        fh.truncate(size)
    if target != path:
        os.replace(target, path)
    return size


class NoRoom(OSError):
    """The staging folder's filesystem (a container's /dev/shm is 64 MB by default) cannot hold
    the weights."""


def check_room(folder: Path, need: int) -> None:
    """NoRoom unless `folder`'s filesystem has `need` more bytes free (files about to be
    overwritten in place count as free)."""
    have = shutil.disk_usage(folder).free + sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if need > have:
        raise NoRoom(f"{folder} is on a filesystem with {have / 2**20:.0f} MB free, and the weights need "
                     f"{need / 2**20:.0f} MB (a container's /dev/shm is 64 MB unless --shm-size says otherwise)")


def stage_tensors(folder: Path, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, Any]:
    """Write `tensors` into `folder` as bucketed safetensors files and their index, over what a
    previous version left there; files of an earlier layout that this one does not have are
    removed. Returns {"files", "bytes", "tensors"}; NoRoom, before writing anything, where the
    filesystem cannot hold them."""
    folder.mkdir(parents=True, exist_ok=True)
    data = sum(t.nbytes for t in tensors.values())
    check_room(folder, data + (1 << 20))
    groups = buckets(tensors, bucket_bytes)
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {n: f for f, group in zip(names, groups) for n in group}
    index_path = folder / INDEX
    previous = json.loads(index_path.read_text()) if index_path.exists() else {}
    same = previous.get("weight_map") == weight_map
    for stale in folder.glob("*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    total = sum(write_safetensors(folder / f, tensors, group, in_place=same) for f, group in zip(names, groups))
    index = {"metadata": {"total_size": data}, "weight_map": weight_map}
    index_path.write_text(json.dumps(index))
    return {"files": names, "bytes": total, "tensors": len(tensors)}


def stage_adapter(folder: Path, adapter: dict[str, torch.Tensor], config: Any) -> dict[str, Any]:
    """LoRA adapters in PEFT's layout (adapter_model.safetensors, adapter_config.json: what
    engines hot-load) in `folder`, each file replaced whole. Returns {"files", "bytes", "tensors"}."""
    folder.mkdir(parents=True, exist_ok=True)
    check_room(folder, 2 * sum(t.nbytes for t in adapter.values()) + (1 << 20))  # new file, then the old goes
    size = write_safetensors(folder / "adapter_model.safetensors", adapter, sorted(adapter), in_place=False)
    config.save_pretrained(str(folder))
    return {"files": ["adapter_model.safetensors", "adapter_config.json"], "bytes": size, "tensors": len(adapter)}


def read_header(fh: Any, path: Path, limit: int = 100 << 20) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (bounded to `limit` bytes) and where its data starts."""
    raw = fh.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header size)")
    (size,) = struct.unpack("<Q", raw)
    if size > limit:
        raise ValueError(f"{path}: a safetensors header of {size} bytes (at most {limit})")
    header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def read_into(path: Path, state: dict[str, torch.Tensor]) -> int:
    """Copy the tensors of the safetensors file `path` into the same-named tensors of `state` in
    place, read straight into their memory (no mapping of the file: a mapped tmpfs file costs a page
    fault per page); a tensor of another dtype, or not contiguous, is read and converted. A name
    `state` lacks or a shape it does not have is a ValueError naming both. Returns the tensors read."""
    by_code = {v: k for k, v in DTYPES.items()}
    with open(path, "rb", buffering=0) as fh:
        header, base = read_header(fh, path)
        unknown = sorted(set(header) - set(state))
        if unknown:
            raise ValueError(f"{path}: tensors the served model does not have: {unknown[:3]}")
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            target, (begin, end) = state[name], info["data_offsets"]
            if list(target.shape) != list(info["shape"]):
                raise ValueError(f"{path}: {name} has shape {tuple(info['shape'])}, the served model {tuple(target.shape)}")
            dtype = by_code.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: {name} has dtype {info['dtype']}, which this reader does not carry")
            fh.seek(base + begin)
            direct = dtype == target.dtype and target.is_contiguous() and target.device.type == "cpu"
            buffer = target if direct else torch.empty(target.shape, dtype=dtype)
            view = buffer.detach().reshape(-1).view(torch.uint8).numpy().data
            done = 0
            while done < end - begin:  # one read returns at most ~2 GiB
                got = fh.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path}: {name} is cut short (the file ends inside it)")
                done += got
            if not direct:
                with torch.no_grad():
                    target.copy_(buffer)
    return len(header)

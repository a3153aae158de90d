"""Checkpoints (torch.distributed.checkpoint, every rank writes its shards) and weight
publication (full safetensors + sha256 manifest), without a single pickle in run storage.

Checkpoint `checkpoints/{version:06d}/`: model and optimizer tensors through DCP's Hugging Face
storage writer (safetensors shards + a JSON index), the optimizer's non-tensor state and the
policy version in `extra.json`, and `_COMMITTED` written last. Generation randomness is derived
from (seed, iteration, sample id), so no RNG state needs saving to resume bit-for-bit.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from stages.storage import join

if TYPE_CHECKING:
    from stages.workers.policy import PolicyWorker

MANIFEST = "manifest.json"


def _flatten(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors for DCP (flat names) and the JSON-able rest of the optimizer state."""
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    scalars: dict[str, Any] = {}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{fqn}.{key}"] = value
            else:
                scalars[f"{fqn}.{key}"] = value
    return tensors, {"param_groups": optim_sd["param_groups"], "scalars": scalars}


def _unflatten(tensors: dict[str, torch.Tensor], model_sd: dict, optim_sd: dict, extra: dict) -> None:
    for k in model_sd:
        model_sd[k] = tensors[f"model.{k}"]
    for fqn, state in optim_sd["state"].items():
        for key in list(state):
            if isinstance(state[key], torch.Tensor):
                state[key] = tensors[f"optim.{fqn}.{key}"]
            else:
                state[key] = extra["scalars"][f"{fqn}.{key}"]
    optim_sd["param_groups"] = extra["param_groups"]


def _local_state_dir(worker: "PolicyWorker", rel: str) -> Path:
    """DCP's safetensors writer needs a local folder: object stores get a per-rank staging copy."""
    if worker.storage.local:
        return worker.storage.local_path(rel)
    staged = worker.scratch / "staging" / rel
    staged.mkdir(parents=True, exist_ok=True)
    return staged


def save(worker: "PolicyWorker") -> dict[str, Any]:
    """Write checkpoint `worker.version` (idempotent: an existing committed one is kept)."""
    start = time.perf_counter()
    storage = worker.storage
    rel = storage.checkpoint_rel(worker.version)
    if storage.exists(join(rel, "_COMMITTED")):
        return {"version": worker.version, "path": rel, "seconds": 0.0, "existing": True}
    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    tensors, extra = _flatten(model_sd, optim_sd)
    tensors.update(_ema_tensors(worker))
    state_rel = join(rel, "state")
    local = _local_state_dir(worker, state_rel)
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(local), save_distributed=True))
    if not storage.local:  # each rank uploads the shard files it wrote
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            storage.put_file(path, join(state_rel, path.relative_to(local).as_posix()))
    dist.barrier()
    if worker.rank == 0:
        storage.write_json(join(rel, "extra.json"), {
            "version": worker.version, "optimizer": extra, "world_size": worker.world,
            "worker": worker.extra_state() if hasattr(worker, "extra_state") else {},
        })
        storage.write_json(join(rel, "_COMMITTED"), {"version": worker.version})
    dist.barrier()
    return {"version": worker.version, "path": rel, "seconds": time.perf_counter() - start, "existing": False}


def load(worker: "PolicyWorker", version: int) -> int:
    """Restore model and optimizer from checkpoint `version` (any world size); returns it."""
    storage = worker.storage
    rel = storage.checkpoint_rel(version)
    if not storage.exists(join(rel, "_COMMITTED")):
        raise FileNotFoundError(f"{storage.url(rel)}: checkpoint is not committed")
    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    tensors, _ = _flatten(model_sd, optim_sd)
    ema = _ema_tensors(worker)
    tensors.update(ema)
    state_rel = join(rel, "state")
    local = storage.local_path(state_rel) if storage.local else storage.get_dir(state_rel, worker.scratch / "restore" / rel)
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(local)))
    extra = storage.read_json(join(rel, "extra.json"))
    _unflatten(tensors, model_sd, optim_sd, extra["optimizer"])
    set_state_dict(worker.model, worker.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    with torch.no_grad():
        for key in ema:
            worker.ema.shadow[key[len("ema."):]].copy_(tensors[key])
    if hasattr(worker, "load_extra_state"):
        worker.load_extra_state(extra.get("worker", {}))
    return int(extra["version"])


def _ema_tensors(worker: "PolicyWorker") -> dict[str, torch.Tensor]:
    ema = getattr(worker, "ema", None)
    return {} if ema is None else {f"ema.{n}": v for n, v in ema.shadow.items()}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def publish(worker: "PolicyWorker") -> dict[str, Any]:
    """Write `weights/v{version:06d}/`: model.safetensors, config, tokenizer, then manifest.json
    with the sha256 of every file (written last: a version without it is incomplete)."""
    start = time.perf_counter()
    storage = worker.storage
    rel = storage.weights_rel(worker.version)
    full = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ema = getattr(worker, "ema", None)
    if ema is not None:  # every rank takes part in gathering the EMA shards
        worker._ema_full = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for n, v in ema.shadow.items()}
    if worker.rank == 0 and not storage.exists(join(rel, MANIFEST)):
        local = worker.scratch / f"publish-{worker.version:06d}"
        local.mkdir(parents=True, exist_ok=True)
        worker.export(local, full)
        write_weights_dir(storage, local, rel, {"version": worker.version})
    dist.barrier()
    return {"version": worker.version, "path": rel, "seconds": time.perf_counter() - start}


def write_weights_dir(storage: Any, local: Path, rel: str, info: dict[str, Any]) -> dict[str, Any]:
    """Upload every file of `local` to `rel`, then the sha256 manifest."""
    files = {}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        name = path.relative_to(local).as_posix()
        storage.put_file(path, join(rel, name))
        files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {**info, "files": files}
    storage.write_json(join(rel, MANIFEST), manifest)
    return manifest


def verify_weights_dir(directory: Path) -> None:
    """Check a downloaded weights folder against its manifest; name the first bad file."""
    import json

    manifest = json.loads((directory / MANIFEST).read_text())
    for name, info in manifest["files"].items():
        if sha256_file(directory / name) != info["sha256"]:
            raise ValueError(f"{directory / name}: sha256 does not match {MANIFEST}; the copy is corrupt")

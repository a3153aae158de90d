"""Checkpoints (torch.distributed.checkpoint, every rank writes its shards) and weight
publication (full safetensors + sha256 manifest), without a single pickle in run storage.

Checkpoint `checkpoints/{version:06d}/`: model and optimizer tensors through DCP's Hugging Face
storage writer (safetensors shards + a JSON index), the optimizer's non-tensor state and the
policy version in `extra.json`, `manifest.json` with the sha256 of every file, and `_COMMITTED`
written last. A restart restores the newest checkpoint that is committed and whose files match
its manifest (`usable_checkpoint`), saying why it passed over newer ones. Generation randomness is derived
from (seed, iteration, sample id), so no RNG state needs saving to resume bit-for-bit.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.storage import join
from unirl.stages.train.manifests import MANIFEST, checkpoint_problem, file_digests, write_weights_dir

if TYPE_CHECKING:
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.train.stack import TrainStack



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


def _local_state_dir(storage: RunStorage, scratch: Path, rel: str) -> Path:
    """DCP's safetensors writer needs a local folder: object stores get a per-rank staging copy."""
    if (local := storage.local_path(rel)) is not None:
        return local
    staged = scratch / "staging" / rel
    staged.mkdir(parents=True, exist_ok=True)
    return staged


def save(stack: TrainStack, storage: RunStorage, scratch: Path, version: int) -> dict[str, Any]:
    """Write checkpoint `version` of the stack (idempotent: an existing committed one is kept)."""
    start = time.perf_counter()
    rel = storage.checkpoint_rel(version)
    if storage.exists(join(rel, "_COMMITTED")):
        if checkpoint_problem(storage, version) is None:
            return {"version": version, "path": rel, "seconds": 0.0, "existing": True}
        stack.barrier()
        if stack.rank == 0:  # a corrupted one is written again, uncommitted until it is whole
            storage.remove(join(rel, "_COMMITTED"))
        stack.barrier()
    model_sd, optim_sd = get_state_dict(stack.module, stack.optimizer)
    tensors, extra = _flatten(model_sd, optim_sd)
    tensors.update(_ema_tensors(stack))
    state_rel = join(rel, "state")
    local = _local_state_dir(storage, scratch, state_rel)
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(local), save_distributed=True))
    if not storage.local:  # each rank uploads the shard files it wrote
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            storage.put_file(path, join(state_rel, path.relative_to(local).as_posix()))
    stack.barrier()
    fault_point("checkpoint", version)  # shards written, nothing committed
    if stack.rank == 0:
        storage.write_json(join(rel, "extra.json"), {
            "version": version, "optimizer": extra, "world_size": stack.world,
            "worker": {"opt_steps": stack.opt_steps, "schedule_steps": stack.spec.total},
        })
        storage.write_json(join(rel, MANIFEST), {"version": version, "files": file_digests(storage, rel)})
        storage.write_json(join(rel, "_COMMITTED"), {"version": version})
    stack.barrier()
    return {"version": version, "path": rel, "seconds": time.perf_counter() - start, "existing": False}


def load(stack: TrainStack, storage: RunStorage, scratch: Path, version: int) -> int:
    """Restore model, optimizer, EMA and schedule position from checkpoint `version` (any world
    size); returns it."""
    rel = storage.checkpoint_rel(version)
    if not storage.exists(join(rel, "_COMMITTED")):
        raise FileNotFoundError(f"{storage.url(rel)}: checkpoint is not committed")
    model_sd, optim_sd = get_state_dict(stack.module, stack.optimizer)
    tensors, _ = _flatten(model_sd, optim_sd)
    ema = _ema_tensors(stack)
    tensors.update(ema)
    state_rel = join(rel, "state")
    local = storage.local_path(state_rel) if storage.local else storage.get_dir(state_rel, scratch / "restore" / rel)
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(local)))
    extra = storage.read_json(join(rel, "extra.json"))
    _unflatten(tensors, model_sd, optim_sd, extra["optimizer"])
    set_state_dict(stack.module, stack.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if stack.ema is not None:
        with torch.no_grad():
            for key in ema:
                stack.ema.shadow[key[len("ema."):]].copy_(tensors[key])
    stack.opt_steps = int(extra.get("worker", {}).get("opt_steps", 0))
    if extra.get("worker", {}).get("schedule_steps"):  # the schedule the saved steps were taken on
        stack.spec = dataclasses.replace(stack.spec, total=int(extra["worker"]["schedule_steps"]))
    return int(extra["version"])


def _ema_tensors(stack: TrainStack) -> dict[str, torch.Tensor]:
    return {} if stack.ema is None else {f"ema.{n}": v for n, v in stack.ema.shadow.items()}


def publish(stack: TrainStack, storage: RunStorage, scratch: Path, version: int,
            export: Callable[[Path, dict[str, torch.Tensor], dict[str, torch.Tensor] | None], None],
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `weights/v{version:06d}/`: `export(folder, full state, full EMA state or None)` on
    rank 0, then manifest.json with the sha256 of every file and, without LoRA (whose export
    merges the adapters into other names), `weights_sha256`: the checksum of the module's tensors,
    which an engine that loaded the folder reports back (stages/runtime/weights_checksum.py), and
    `extra` (the canary, stages/runtime/canary.py). The manifest
    is written last: a version without it is incomplete. Every rank takes part in gathering the
    full states (a rank-0-only gather deadlocks under FSDP2)."""
    start = time.perf_counter()
    rel = storage.weights_rel(version)
    full = cast("dict[str, torch.Tensor]", get_model_state_dict(stack.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    ema_full = full_ema(stack)
    if stack.rank == 0 and not storage.exists(join(rel, MANIFEST)):
        local = scratch / f"publish-{version:06d}"
        local.mkdir(parents=True, exist_ok=True)
        export(local, full, ema_full)
        info: dict[str, Any] = {"version": version, **(extra or {})}
        if stack.lora is None:
            from unirl.stages.runtime.weights_checksum import tensors_checksum  # start-up time: loaded on first use

            info["weights_sha256"] = tensors_checksum(full.items())
        write_weights_dir(storage, local, rel, info)
    stack.barrier()
    return {"version": version, "path": rel, "seconds": time.perf_counter() - start}


def full_ema(stack: TrainStack) -> dict[str, torch.Tensor] | None:
    """The EMA's full tensors on the CPU (every rank gathers its shards), None without an EMA."""
    if stack.ema is None:
        return None
    return {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for n, v in stack.ema.shadow.items()}

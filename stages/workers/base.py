"""What every model family's worker shares: its run storage and scratch folder, the command
dispatch, and persistence through stages/workers/checkpoint.py. Subclasses load their model and
implement generate / train / sft / export."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stages.recipe import Recipe
from stages.storage import RunStorage
from stages.workers import checkpoint
from stages.workers.ar_train import lr_factor

COMMANDS = ("ping", "generate", "train", "sft", "save", "publish")


def shard(model: torch.nn.Module, units: list[torch.nn.Module], mesh: Any) -> torch.nn.Module:
    """FSDP2 `fully_shard` on each unit (decoder layer, transformer block) and at the root. A
    one-rank group keeps the plain module: sharding there is a copy and two hooks per unit and
    forward with nothing to shard (measured 4x slower on the tiny Qwen3's train step, +0.3 s per
    diffusion quickstart iteration); checkpoints and publication read both the same way."""
    from torch.distributed.fsdp import fully_shard

    if (mesh.size() if mesh is not None else dist.get_world_size()) == 1:
        return model
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class WorkerBase:
    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        self.recipe = Recipe.model_validate(spec["recipe"])
        self.storage = RunStorage(spec["root"], spec["run"], spec.get("options"))
        self.mesh, self.device = mesh, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.scratch = Path(spec["scratch"]) / f"rank{self.rank}"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.base_dir = self._local_weights(spec["init_weights"])
        self.opt_steps = 0
        self.version = int(spec["init_version"])

    def ema_decay(self) -> float:
        """Decay of the EMA update after optimizer step `self.opt_steps` (the recipe's, by default)."""
        return self.recipe.train.ema.decay

    def _optimizer_step(self) -> float:
        """Clip, then step at the scheduled lr unless the grad norm is non-finite (a skipped step),
        then update the EMA. Needs `self.trainable`, `self.optimizer`, `self.model`, `self.ema`.
        Returns the norm."""
        t = self.recipe.train
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, t.max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if np.isfinite(norm):
            total = self.recipe.iterations * t.updates_per_batch
            factor = lr_factor(self.opt_steps, schedule=t.lr_schedule, warmup=t.warmup_steps, total=total, min_ratio=t.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = t.lr * factor
            self.optimizer.step()
            if self.ema is not None:
                self.ema.decay = self.ema_decay()
                self.ema.update(self.model)
            self.opt_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _local_weights(self, rel: str) -> Path:
        """A run folder as a local path (object stores: a per-rank copy in the scratch folder)."""
        if self.storage.local:
            return self.storage.local_path(rel)
        return self.storage.get_dir(rel, self.scratch / "init_weights")

    def restore(self, spec: dict[str, Any]) -> None:
        """Load the checkpoint the group was started from, once model and optimizer exist."""
        if spec.get("checkpoint") is not None:
            self.version = checkpoint.load(self, int(spec["checkpoint"]))

    def execute(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        if cmd not in COMMANDS:
            raise ValueError(f"unknown worker command {cmd!r} (allowed: {', '.join(COMMANDS)})")
        return getattr(self, cmd)(**args)

    def ping(self) -> dict[str, Any]:
        return {"version": self.version, "world_size": self.world}

    def save(self) -> dict[str, Any]:
        return checkpoint.save(self)

    def publish(self) -> dict[str, Any]:
        return checkpoint.publish(self)

    def extra_state(self) -> dict[str, Any]:
        """Checkpointed besides model and optimizer tensors: the schedule's position."""
        return {"opt_steps": self.opt_steps}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        self.opt_steps = int(extra.get("opt_steps", 0))

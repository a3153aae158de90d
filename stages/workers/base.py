"""What every model family's worker shares: its run storage and scratch folder, the command
dispatch, and persistence through stages/workers/checkpoint.py. Subclasses load their model and
implement generate / train / sft / export."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stages.recipe import Recipe
from stages.storage import RunStorage
from stages.workers import checkpoint

COMMANDS = ("ping", "generate", "train", "sft", "save", "publish")


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

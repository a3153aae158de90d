"""The whole RL iteration in one process: the same worker (family, policy, algorithm, train stack)
and the same data stages as a flow run, on in-memory storage, with no Prefect, no worker group,
no torchrun and no disk. It is the floor `benchmarks/diffusion_step.py` compares the flow against,
and a quick way to try hyperparameters from a notebook.

    loop = InProcessLoop(recipe, weights_dir)            # device="cuda" on a GPU; dtype: recipe.model.dtype
    for i in range(n): metrics = loop.iteration(i)
"""
from __future__ import annotations

import tempfile
import time
import uuid
from typing import Any

import torch

from unirl.stages.distill import taught_by
from unirl.stages.run import iteration as it
from unirl.stages.runtime.accumulation import closes, window
from unirl.stages.runtime.storage import RunStorage, iter_dir


class InProcessLoop:
    def __init__(self, recipe: Any, weights_dir: str, *, device: str | torch.device = "cpu"):
        from unirl.stages.workers.worker import Worker

        self.recipe = recipe
        self.storage = RunStorage(f"memory://unirl-loop-{uuid.uuid4().hex}", "loop")
        self._scratch = tempfile.TemporaryDirectory(prefix="unirl-loop-")
        spec = {"recipe": recipe.model_dump(mode="json"), "root": self.storage.root, "run": "loop",
                "weights_dir": str(weights_dir), "init_version": 0, "scratch": self._scratch.name, "mode": "rl"}
        self.worker = Worker(spec, None, torch.device(device))
        self.waiting: list[dict[str, Any]] = []  # the batches of the accumulation window so far

    def iteration(self, iteration: int) -> dict[str, float]:
        """Generate, score, advantage and train iteration `iteration`; its metrics as a flow run
        logs them (`train/*`, `rollout/*`, `time/<stage>_s`)."""
        times: dict[str, float] = {}
        start = time.perf_counter()
        requests = it.write_requests(self.storage, self.recipe, iteration)["files"][0]
        gen = self.worker.generate(iteration=iteration, requests=requests, out_dir=f"{iter_dir(iteration)}/rollouts")
        times["generate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        scored = it.score(self.storage, self.recipe, iteration, gen["files"])
        taught = [f for t in taught_by(self.recipe) for f in self.worker.teach(
            iteration=iteration, rollouts=gen["files"], teacher=t, out_dir=f"{iter_dir(iteration)}/teacher-{t}")["files"]]
        adv = it.advantages(self.storage, self.recipe, iteration, scored["files"], gen["files"], taught)
        times["score_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if not closes(self.recipe, iteration):  # rollout accumulation: the window's last iteration updates on it
            self.waiting.append({"rollouts": gen["files"], "advantages": adv["files"][0]})
            metrics: dict[str, Any] = {"accumulated_batches": len(self.waiting)}
        else:
            metrics = self.worker.train(iteration=iteration, rollouts=gen["files"], advantages=adv["files"][0],
                                        earlier=self.waiting or None)["metrics"]
            if self.waiting:
                metrics["accumulated_batches"] = len(self.waiting) + 1
            for j in window(self.recipe, iteration):  # memory stays flat
                self.storage.fs.rm(self.storage.path(iter_dir(j)), recursive=True)
            self.waiting = []
        times["train_s"] = time.perf_counter() - start
        out = {f"train/{k}": v for k, v in metrics.items()}
        out.update({f"time/{k}": v for k, v in times.items()})
        out.update(scored["metrics"])
        out.update(adv["metrics"])
        return out

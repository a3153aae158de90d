"""The whole RL iteration in one process: the same worker (family, policy, algorithm, train stack)
and the same data stages in the same sequence (sequence.py) as a flow run, on in-memory storage,
with no Prefect, no worker group, no torchrun and no disk. It is the floor `benchmarks/diffusion_step.py` compares the flow against,
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
from unirl.stages.run.sequence import Batch, Steps, Update, run_iteration
from unirl.stages.runtime.accumulation import closes, window
from unirl.stages.runtime.storage import RunStorage, iter_dir
from unirl.stages.workers.worker import Worker


class InProcessLoop:
    def __init__(self, recipe: Any, weights_dir: str, *, device: str | torch.device = "cpu"):
        self.recipe = recipe
        self.storage = RunStorage(f"memory://unirl-loop-{uuid.uuid4().hex}", "loop")
        self._scratch = tempfile.TemporaryDirectory(prefix="unirl-loop-")
        spec = {"recipe": recipe.model_dump(mode="json"), "root": self.storage.root, "run": "loop",
                "weights_dir": str(weights_dir), "init_version": 0, "scratch": self._scratch.name, "mode": "rl"}
        self.worker = Worker(spec, None, torch.device(device))
        self.waiting: list[dict[str, Any]] = []  # the batches of the accumulation window so far

    def iteration(self, iteration: int) -> dict[str, float]:
        """Iteration `iteration` through the run's sequence (sequence.py) on the worker directly;
        its metrics as a flow run logs them (`train/*`, `rollout/*`, `time/<stage>_s`)."""
        return run_iteration(self.recipe, iteration, self.steps(iteration))["metrics"]

    def steps(self, iteration: int) -> Steps:
        recipe, storage, worker = self.recipe, self.storage, self.worker

        def generate(r: int) -> Batch:
            requests, = it.write_requests(storage, recipe, iteration, r)["files"]
            gen = timed(worker.generate, iteration=iteration, requests=requests,
                        out_dir=f"{iter_dir(iteration)}/rollouts" + (f"/r{r}" if r else ""))
            return Batch(gen["files"], {"": gen["files"]}, times={"time/generate_s": gen["seconds"]})

        def teach(rollouts: list[str]) -> list[dict[str, Any]]:
            return [timed(worker.teach, iteration=iteration, rollouts=rollouts, teacher=t,
                          out_dir=f"{iter_dir(iteration)}/teacher-{t}") for t in taught_by(recipe)]

        def update(rollouts: dict[str, list[str]], adv: dict[str, Any]) -> Update:
            start = time.perf_counter()
            if not closes(recipe, iteration):  # rollout accumulation: the window's last iteration updates on it
                self.waiting.append({"rollouts": rollouts[""], "advantages": adv["files"][0]})
                metrics: dict[str, Any] = {"accumulated_batches": len(self.waiting)}
            else:
                metrics = worker.train(iteration=iteration, rollouts=rollouts[""], advantages=adv["files"][0],
                                       earlier=self.waiting or None)["metrics"]
                if self.waiting:
                    metrics["accumulated_batches"] = len(self.waiting) + 1
                for j in window(recipe, iteration):  # memory stays flat
                    storage.fs.rm(storage.path(iter_dir(j)), recursive=True)
                self.waiting = []
            return Update({f"train/{k}": v for k, v in metrics.items()}, {"time/train_s": time.perf_counter() - start})

        return Steps(
            generate=generate,
            score=lambda files, r: timed(it.score, storage, recipe, iteration, files, round_index=r),
            advantage=lambda rewards, rollouts, taught: timed(it.advantages, storage, recipe, iteration, rewards,
                                                              rollouts, taught),
            update=update, teach=teach)


def timed(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`fn`'s manifest with the seconds it took (what a committed stage records)."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return {**out, "seconds": time.perf_counter() - start}

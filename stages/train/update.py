"""The RL update and the SFT steps over a train stack, for any policy and algorithm.

RL update of one batch: this rank's rows (the sorted rows [rank::world]) are cut by the train
stack into `train.updates_per_batch` mini-batches of micro-batches (the cut sampling used), one
optimizer step per mini-batch. Before the first step the algorithm freezes what it needs of the old policy (with the EMA
weights swapped in when the algorithm samples with them). A micro-batch's share of its step's
loss is its units (tokens, sequences or samples, as the algorithm says) over the step's total
across ranks. Ranks short of micro-batches run stand-ins of weight 0, so every rank issues the
same collectives in the same order. Metrics are averaged with the policy's weights (tokens,
samples); keys naming a max or ending in `_min` are the max / min across everything.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from stages.algorithms.base import TrainContext


def _extreme(key: str) -> str | None:
    if key.endswith("_min"):
        return "min"
    return "max" if "max" in key.split("_") else None


def rl_update(stack: Any, policy: Any, algo: Any, batches: list[list[Any]], counts: list[int], *, iteration: int,
              seed: int, tolerance: float) -> dict[str, Any]:
    """One optimizer step per mini-batch: `batches[k]` are this rank's micro-batches of mini-batch
    k, `counts[k]` the most any rank has. Returns the update's metrics."""
    template = policy.template(next((b for group in batches for b in group), None), stack)

    def get(k: int, j: int) -> tuple[Any, float]:
        return (batches[k][j], 1.0) if j < len(batches[k]) else (policy.stand_in(template), 0.0)

    ctx = TrainContext(policy, stack, iteration, seed, tolerance, stack.rank)
    stack.module.train()
    frozen: dict[tuple[int, int], Any] = {}
    with torch.no_grad(), stack.maybe_ema(algo.samples_with_ema):
        for k, count in enumerate(counts):
            for j in range(count):
                old = algo.freeze_old(ctx, get(k, j)[0], k)
                if old is not None:
                    frozen[(k, j)] = old
    totals: dict[str, float] = {}
    extremes: dict[str, float] = {}
    weight = 0.0
    norms, skipped = [], 0
    for k, count in enumerate(counts):
        total = torch.tensor([float(sum(algo.units(b) for b in batches[k]))], dtype=torch.float64, device=stack.device)
        stack.all_reduce(total)
        for j in range(count):
            b, real = get(k, j)
            share = real * algo.units(b) / max(float(total[0]), 1.0)
            metrics = algo.loss_backward(ctx, b, frozen.get((k, j)), share=share, update=k, real=bool(real))
            w = b.weight * real
            for key, value in metrics.items():
                kind = _extreme(key)
                if kind is None:
                    totals[key] = totals.get(key, 0.0) + (value * w if real else 0.0)
                elif real:
                    sign = 1.0 if kind == "max" else -1.0
                    extremes[key] = max(extremes.get(key, -np.inf), sign * value)
                else:
                    extremes.setdefault(key, -np.inf)
            weight += w
        norm = stack.step()
        if np.isfinite(norm):
            norms.append(norm)
        else:
            skipped += 1
    out = stack.reduce_metrics(totals, weight, extremes, policy.weight_name)
    for key in extremes:
        if _extreme(key) == "min":
            out[key] = -out[key]
    out.update({"grad_norm": float(np.mean(norms)) if norms else float("nan"), "skipped_steps": skipped, "lr": stack.lr})
    return out


def sft_steps(stack: Any, policy: Any, start_step: int, steps: int, *, seed: int, batch_size: int) -> dict[str, Any]:
    """SFT steps [start_step, start_step + steps) of the policy's supervised objective; the batch
    of step s is a function of (seed, s), so chunks of steps give what one long call gives."""
    start = time.perf_counter()
    losses = []
    stack.module.train()
    for step in range(start_step, start_step + steps):
        loss, value = policy.sft_loss(stack.module, step, seed=seed, batch_size=batch_size, stack=stack)
        loss.backward()
        stack.step()
        total = value.detach().to(torch.float64).reshape(1)
        stack.all_reduce(total)
        losses.append(float(total))
    return {"loss": float(np.mean(losses)), "last_loss": losses[-1], "steps": start_step + steps,
            "seconds": time.perf_counter() - start}

"""The RL update and the SFT steps over a train stack, for any policy and algorithm.

RL update of one batch: this rank's rows (the sorted rows [rank::world]) are cut by the train
stack into `train.updates_per_batch` mini-batches of micro-batches (the cut sampling used), one
optimizer step per mini-batch. Before the first step the algorithm freezes what it needs of the old
policy (with the EMA weights swapped in when the algorithm samples with them). A micro-batch's
share of its step's loss is its units (tokens, sequences or samples, as the algorithm says) over
the step's total across ranks. With rollout accumulation the update is on a window's batches, each
cut so, mini-batch k holding every batch's k-th: the step's total is then the union's. Ranks short
of micro-batches run stand-ins of weight 0, so every rank issues the same collectives in the same
order. Metrics are averaged with the policy's weights (tokens, samples); keys naming a max or
ending in `_min` are the max / min across everything; `loss` is the step's loss (each
micro-batch's at its share), averaged over the steps, so no cut of the batch changes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unirl.stages.algorithms.base import TrainContext, extreme, judge_masked


@dataclass
class UpdatePart:
    """One policy's share of an optimizer step: its algorithm, this rank's micro-batches
    (`batches[k]`: of mini-batch k; `counts[k]`: the most any rank has), the behaviour tolerance
    of its on-policy check, the weight of its loss, the prefix of its metrics, and the check's
    mask band (stages/kernels/behaviour.py: `check_behaviour`)."""

    policy: Any
    algo: Any
    batches: list[list[Any]]
    counts: list[int]
    tolerance: float
    weight: float = 1.0
    prefix: str = ""
    mask_limit: float | None = None
    max_masked_frac: float = 0.0


def joint_update(stack: Any, parts: list[UpdatePart], *, iteration: int, seed: int, version: int | None = None) -> dict[str, Any]:
    """One optimizer step per mini-batch k, into which every part's micro-batches of mini-batch k
    accumulate their gradients: a part's loss is its algorithm's (each micro-batch's share of it
    is its units over the part's total across ranks) times the part's weight. A unified model
    trains its text and image stages this way on one set of weights (stages/compose/unified.py).
    `version`: the policy version the stack holds (TrainContext). Returns each part's metrics under
    its prefix, and the step's."""
    updates = {len(p.counts) for p in parts}
    if len(updates) != 1:
        raise ValueError(f"the parts of a joint update cut their batches into different numbers of updates: {sorted(updates)}")
    stack.module.train()
    states: list[dict[str, Any]] = []
    for part in parts:
        template = part.policy.template(next((b for group in part.batches for b in group), None), stack)

        def get(k: int, j: int, part: UpdatePart = part, template: Any = template) -> tuple[Any, float]:
            return (part.batches[k][j], 1.0) if j < len(part.batches[k]) else (part.policy.stand_in(template), 0.0)

        ctx = TrainContext(part.policy, stack, iteration, seed, part.tolerance, stack.rank, version,
                           mask_limit=part.mask_limit, max_masked_frac=part.max_masked_frac)
        frozen: dict[tuple[int, int], Any] = {}
        with torch.no_grad(), stack.maybe_ema(part.algo.samples_with_ema):
            for k, count in enumerate(part.counts):
                for j in range(count):
                    old = part.algo.freeze_old(ctx, get(k, j)[0], k)
                    if old is not None:
                        frozen[(k, j)] = old
        states.append({"get": get, "ctx": ctx, "frozen": frozen, "totals": {}, "extremes": {}, "weight": 0.0, "objective": 0.0})
    norms, skipped = [], 0
    for k in range(updates.pop()):
        for part, st in zip(parts, states):
            algo = part.algo
            total = torch.tensor([float(sum(algo.units(b) for b in part.batches[k]))], dtype=torch.float64, device=stack.device)
            stack.all_reduce(total)
            for j in range(part.counts[k]):
                b, real = st["get"](k, j)
                share = part.weight * real * algo.units(b) / max(float(total[0]), 1.0)
                metrics = algo.loss_backward(st["ctx"], b, st["frozen"].get((k, j)), share=share, update=k, real=bool(real))
                if real and "loss" in metrics:  # the step's loss: each micro-batch's at its share, whatever the cut
                    st["objective"] += real * algo.units(b) / max(float(total[0]), 1.0) * metrics["loss"]
                w = b.weight * real
                for key, value in metrics.items():
                    kind = extreme(key)
                    if kind is None:
                        st["totals"][key] = st["totals"].get(key, 0.0) + (value * w if real else 0.0)
                    elif real:
                        sign = 1.0 if kind == "max" else -1.0
                        st["extremes"][key] = max(st["extremes"].get(key, -np.inf), sign * value)
                    else:
                        st["extremes"].setdefault(key, -np.inf)
                st["weight"] += w
            judge_masked(st["ctx"])  # too many samples a hair off their record is a real misalignment
        norm = stack.step()
        if np.isfinite(norm):
            norms.append(norm)
        else:
            skipped += 1
    out: dict[str, Any] = {}
    for part, st in zip(parts, states):
        metrics = stack.reduce_metrics(st["totals"], st["weight"], st["extremes"], part.policy.weight_name)
        for key in st["extremes"]:
            if extreme(key) == "min":
                metrics[key] = -metrics[key]
        if "loss" in metrics:  # the mean over the optimizer steps of each step's loss, summed over ranks
            objective = torch.tensor([st["objective"]], dtype=torch.float64, device=stack.device)
            stack.all_reduce(objective)
            metrics["loss"] = float(objective[0]) / len(part.counts)
        out.update({part.prefix + key: value for key, value in metrics.items()})
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

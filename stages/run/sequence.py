"""The iteration sequence, written once for every run shape (docs/architecture.md, "One iteration's
data path"):

    generate -> score -> [refill: generate, score again while dynamic sampling finds too few
    informative groups] -> teachers -> advantage -> update (train, then sync)

A shape supplies the steps (`Steps`): the single model's Prefect tasks, a pipeline's or a unified
model's chain of parts (flows/shapes/), the in-process loop's direct worker calls (loop.py). The
order, the refill rule and what the iteration reports (its metrics and stage timings) are here.
Rollout accumulation is the update's: a step that closes no window commits a batch that waits
(tasks/train.py, loop.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unirl.stages.recipe import Recipe


@dataclass
class Batch:
    """One round's samples.

    `scored`: the files scoring reads (a single model's rollouts, a composed run's composed rows);
    `trained`: by model, the files its train step reads (a single model's: under ""); `metrics`:
    what sampling reports (async RL: staleness and what was dropped); `times`: `time/<stage>_s`."""

    scored: list[str]
    trained: dict[str, list[str]]
    metrics: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class Update:
    """What the update did: its metrics (`train/...`), its timings and what the iteration's summary
    keeps of it (the policy version the next iteration samples with, the checkpoint and weights
    it wrote)."""

    metrics: dict[str, float]
    times: dict[str, float]
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Steps:
    """One shape's steps of iteration `iteration` (each commits its output, so a resumed iteration
    returns what was committed instead of doing it again).

    generate(round) -> Batch; score(files, round) -> its manifest (`files`, `metrics`,
    `informative_groups`); teach(rollout files) -> the teachers' manifests; advantage(reward
    files, rollout files, teacher files) -> its manifest; update(files by model, advantage
    manifest) -> Update."""

    generate: Callable[[int], Batch]
    score: Callable[[list[str], int], dict[str, Any]]
    advantage: Callable[[list[str], list[str], list[str]], dict[str, Any]]
    update: Callable[[dict[str, list[str]], dict[str, Any]], Update]
    teach: Callable[[list[str]], list[dict[str, Any]]] | None = None


def seconds(manifest: dict[str, Any]) -> float:
    """How long a stage took when it ran (a resumed stage reports its first run's time)."""
    return float(manifest.get("seconds", 0.0))


def run_iteration(recipe: Recipe, iteration: int, steps: Steps) -> dict[str, Any]:
    """Iteration `iteration` through `steps`: its summary (`iteration`, `metrics`, what the update
    records), which the run commits as the iteration's `_SUCCESS`."""
    start = time.perf_counter()
    batches, scores = [steps.generate(0)], []
    scores.append(steps.score(batches[0].scored, 0))
    informative = scores[0].get("informative_groups", 0)
    refill = recipe.rollout.dynamic_sampling
    while refill is not None and informative < recipe.rollout.prompts_per_iteration and len(scores) < refill.max_rounds:
        r = len(scores)  # DAPO: fresh prompts while too many groups carry no signal
        batches.append(steps.generate(r))
        scores.append(steps.score(batches[r].scored, r))
        informative += scores[r].get("informative_groups", 0)
    rollouts = [f for b in batches for f in b.scored]
    taught = steps.teach(rollouts) if steps.teach is not None else []
    adv = steps.advantage([f for s in scores for f in s["files"]], rollouts, [f for t in taught for f in t["files"]])
    trained: dict[str, list[str]] = {}
    for b in batches:
        for name, files in b.trained.items():
            trained.setdefault(name, []).extend(files)
    update = steps.update(trained, adv)

    metrics: dict[str, float] = dict(batches[0].metrics)
    metrics.update(scores[0]["metrics"])  # the first round's rewards: what the policy samples
    metrics.update(adv["metrics"])
    metrics.update(update.metrics)
    for b in batches:
        for key, value in b.times.items():
            metrics[key] = metrics.get(key, 0.0) + value
    metrics["time/score_s"] = sum(seconds(s) for s in scores)
    if taught:
        metrics["time/teacher_s"] = sum(seconds(t) for t in taught)
    metrics["time/advantage_s"] = seconds(adv)
    metrics.update(update.times)
    metrics["time/iteration_s"] = time.perf_counter() - start
    return {"iteration": iteration, **update.record, "metrics": metrics}

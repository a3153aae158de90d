"""Rollout accumulation (`train.accumulate_rollouts: M`): the run's iterations in windows of M, one
optimizer step per window, and the policy versions that follow from it.

Every iteration of a window generates, scores and computes its advantages on its own (a group
never spans iterations). The train step of its last iteration (`closes`) takes the update on the
rows of the whole window as one batch (docs/accumulation.md: the loss normalised over their
union); the other iterations' train steps take none and publish nothing. A policy version counts
optimizer-step windows, so it is the same for every iteration of a window:

    M = 2   iteration           0 1 | 2 3 | 4 5
            version_of(i)       0 0 | 1 1 | 2 2     samples it (sync), trains on it
            version_after(i)    0 1 | 1 2 | 2 3     after its train step

M = 1 is a run without accumulation: version_of(i) = i, version_after(i) = i + 1.
"""
from __future__ import annotations

from typing import Any


def accumulated(recipe: Any) -> int:
    """M: the rollout batches (iterations) of one optimizer-step window."""
    return int(recipe.train.accumulate_rollouts)


def version_of(recipe: Any, iteration: int) -> int:
    """The policy version the trainer holds while iteration `iteration` runs: the windows before
    its own, each one version (sync RL samples the iteration with it)."""
    return iteration // accumulated(recipe)


def version_after(recipe: Any, iteration: int) -> int:
    """The policy version once iteration `iteration` is trained (one more at a window's end)."""
    return (iteration + 1) // accumulated(recipe)


def closes(recipe: Any, iteration: int) -> bool:
    """Whether `iteration` is the last of its window: its train step takes the window's update."""
    return (iteration + 1) % accumulated(recipe) == 0


def window(recipe: Any, iteration: int) -> range:
    """The iterations of the window `iteration` belongs to."""
    m = accumulated(recipe)
    first = iteration - iteration % m
    return range(first, first + m)


def final_version(recipe: Any) -> int:
    """The policy version the run ends with (`iterations` is a multiple of M)."""
    return recipe.iterations // accumulated(recipe)


def closing_iteration(recipe: Any, version: int) -> int:
    """The iteration whose train step made policy `version` (>= 1)."""
    return version * accumulated(recipe) - 1


def iterations_error(recipe: Any, iterations: int) -> str | None:
    """Why a run of `iterations` cannot accumulate `train.accumulate_rollouts` batches per step, or None."""
    m = accumulated(recipe)
    if iterations % m == 0:
        return None
    return (f"iterations: {iterations} is not a multiple of train.accumulate_rollouts ({m}): the last "
            f"{iterations % m} iteration(s) would sample batches that no optimizer step trains; set iterations to "
            f"{iterations - iterations % m or m} or {iterations - iterations % m + m}")


def schedule_steps(recipe: Any, iterations: int) -> int:
    """Optimizer steps of the learning-rate schedule: those of the run's first length, one update
    (`train.updates_per_batch` steps) per window of `train.accumulate_rollouts` iterations. An
    extended run keeps it (a step that was taken replays with the learning rate it was taken with);
    past it a linear or cosine schedule stays at its final lr (`train.min_lr_ratio` * lr)."""
    return iterations // accumulated(recipe) * recipe.train.updates_per_batch

"""advantage: advantages.arrow from rewards.arrow (group z-scores; with distillation, per token)."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.tasks.common import committed, storage_of


@task(name="advantage", cache_policy=NO_CACHE)
def advantage(recipe: Recipe, run_name: str, iteration: int, rewards: list[str], rollouts: list[str] | None = None,
              teachers: list[str] | None = None) -> dict[str, Any]:
    """`rollouts` and `teachers` (the teachers' shards): on-policy distillation's per-token signal."""
    storage = storage_of(recipe, run_name)
    return committed(storage, iteration, "advantage",
                        lambda: it.advantages(storage, recipe, iteration, rewards, rollouts, teachers))

"""score: rewards.arrow from the rollouts and the recipe's scorers."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.tasks.common import committed, say_retry, storage_of


@task(name="score", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      retry_condition_fn=say_retry)
def score(recipe: Recipe, run_name: str, iteration: int, rollouts: list[str], round_index: int = 0) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    return committed(
        storage, iteration, f"score{it.round_suffix(round_index)}",
        lambda: it.score(storage, recipe, iteration, rollouts, round_index=round_index),
    )

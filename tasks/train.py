"""train: one policy update on the worker group; writes train.json (the update's metrics).

A committed train step is not run again here: whichever task next needs the weights calls
`ensure`, which replays it from storage if the live group does not hold it.
"""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.runtime import iteration as it
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import engine_of, group_of, say_retry, storage_of


@task(name="train", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def train(recipe: Recipe, run_name: str, iteration: int, rollouts: list[str], advantages: str) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)

    def make() -> dict[str, Any]:
        group = group_of(recipe, storage)
        engine_of(recipe, storage).release()  # colocated layout: the engine's memory is the trainer's now
        group.ensure(iteration)
        result = group.call("train", iteration=iteration, rollouts=rollouts, advantages=advantages)
        rel = join(iter_dir(iteration), "train.json")
        storage.write_json(rel, result)
        return {"files": [rel], **result}

    return it.committed(storage, iteration, "train", make)

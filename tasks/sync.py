"""sync: record the policy version the next iteration samples with; checkpoint and publish
weights every `checkpoint_every` versions and at the last one; an engine that holds its own
weights gets them every `rollout.engine.sync.every` updates (full or as LoRA adapters, staged
in shared memory or published, then loaded and checked by the canary; in async RL only
published: the producer loads them, this is the barrier; stages/engines/dedicated.py).
Trainside rollout shares the training weights, so there is nothing to load. An iteration that
took no update (rollout accumulation: not the last of its window) makes no
version: nothing to save, publish or load."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.accumulation import closes, final_version, version_after
from unirl.tasks.common import committed, engine_of, group_of, storage_of


@task(name="sync", cache_policy=NO_CACHE)
def sync(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    version = version_after(recipe, iteration)

    def make() -> dict[str, Any]:
        out: dict[str, Any] = {"policy_version": version, "engine": recipe.rollout.engine.name, "files": []}
        if not closes(recipe, iteration):
            return out
        engine = engine_of(recipe, storage)
        group = group_of(recipe, storage)
        if version % recipe.checkpoint_every == 0 or version == final_version(recipe):
            group.ensure(version)
            out["checkpoint"] = group.call("save")["path"]
            out["weights"] = group.call("publish")["path"]
        if engine.own_weights:
            out["engine_sync"] = engine.sync(group, version)
            engine.resume()
        return out

    return committed(storage, iteration, "sync", make)

"""sync: record the policy version the next iteration samples with; checkpoint and publish
weights every `checkpoint_every` iterations and at the last one. Trainside rollout shares the
training weights, so there is no engine to update."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from stages import iteration as it
from stages.recipe import Recipe
from tasks.common import group_of, storage_of


@task(name="sync", cache_policy=NO_CACHE)
def sync(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    version = iteration + 1

    def make() -> dict[str, Any]:
        out: dict[str, Any] = {"policy_version": version, "backend": recipe.rollout.backend, "files": []}
        if version % recipe.checkpoint_every == 0 or version == recipe.iterations:
            group = group_of(recipe, storage)
            group.ensure(version)
            out["checkpoint"] = group.call("save")["path"]
            out["weights"] = group.call("publish")["path"]
        return out

    return it.committed(storage, iteration, "sync", make)

"""produce: the async producer's batch of one iteration: its requests, sampled on the dedicated
engine with the policy version the staleness bound schedules (stages/run/async_rollout.py), committed
as stage `produce` (the trainer's generate stage waits for it)."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.engines.dedicated import DedicatedEngine
from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import committed, engine_of, say_retry, storage_of


# Tagged `engine`, not `gpu`: it runs on the engine's devices, and the trainer's generate task,
# which holds a `gpu` slot while it waits for this batch, must not stand between it and a slot.
@task(name="produce", cache_policy=NO_CACHE, tags=["engine"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def produce(recipe: Recipe, run_name: str, iteration: int, version: int) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    requests = committed(storage, iteration, "requests", lambda: it.write_requests(storage, recipe, iteration))

    carried = None
    if getattr(recipe.rollout, "partial", None) is not None:  # partial rollouts: the previous batch's unfinished groups go on
        before = storage.stage_manifest(iteration - 1, "produce") if iteration > 0 else {"carry": ""}
        if before is None:
            raise RuntimeError(f"{storage.url(iter_dir(iteration - 1))}: batch {iteration - 1} is not committed; with "
                               "rollout.partial the producer samples batches in order (its unfinished groups go on in the next)")
        carried = before["carry"]

    def make() -> dict[str, Any]:
        out_dir = join(iter_dir(iteration), "rollouts")
        engine = engine_of(recipe, storage)
        if carried is None:
            return engine.generate(requests["files"][0], out_dir, iteration, policy_version=version)
        if not isinstance(engine, DedicatedEngine):  # validate refuses it: rollout.partial is for dedicated engines' text
            raise TypeError(f"rollout.partial: engine {type(engine).__name__} does not sample partial rollouts")
        return engine.generate(requests["files"][0], out_dir, iteration, policy_version=version, carried=carried)

    return committed(storage, iteration, "produce", make)

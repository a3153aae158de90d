"""train: one policy update on the worker group; writes train.json (the update's metrics).

With rollout accumulation (`train.accumulate_rollouts: M`, stages/runtime/accumulation.py) only
the last iteration of each window of M updates, on the batches of every iteration of the window
(the earlier ones from their committed manifests); the others commit a train step that took none
(`"update": false`) and leave the worker group alone.

A committed train step is not run again here: whichever task next needs the weights calls
`ensure`, which replays it from storage if the live group does not hold it.
"""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.accumulation import accumulated, closes, version_of, window
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import committed, engine_of, group_of, say_retry, storage_of


@task(name="train", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def train(recipe: Recipe, run_name: str, iteration: int, rollouts: list[str], advantages: str) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    rel = join(iter_dir(iteration), "train.json")
    m = accumulated(recipe)
    batches = window(recipe, iteration)

    def make() -> dict[str, Any]:
        if not closes(recipe, iteration):  # the batch waits, committed, for its window's last iteration
            waiting: dict[str, Any] = {
                "iteration": iteration, "policy_version": version_of(recipe, iteration), "update": False,
                "window": [batches[0], batches[-1]], "metrics": {"accumulated_batches": iteration - batches[0] + 1}}
            storage.write_json(rel, waiting)
            return {"files": [rel], **waiting}
        group = group_of(recipe, storage)
        engine_of(recipe, storage).release()  # colocated layout: the engine's memory is the trainer's now
        group.ensure(version_of(recipe, iteration))
        earlier = [earlier_batch(storage, j) for j in batches if j < iteration]
        result = group.call("train", iteration=iteration, rollouts=rollouts, advantages=advantages,
                            **({"earlier": earlier} if earlier else {}))
        if m > 1:
            result.update(update=True, window=[batches[0], batches[-1]], metrics={**result["metrics"], "accumulated_batches": m})
        storage.write_json(rel, result)
        return {"files": [rel], **result}

    return committed(storage, iteration, "train", make)


def earlier_batch(storage: Any, iteration: int) -> dict[str, Any]:
    """An earlier batch of the window: what its committed manifests say its train step reads."""
    batch = it.committed_batch(storage, iteration)
    if batch is None:
        raise RuntimeError(f"{storage.url(iter_dir(iteration))}: committed (_SUCCESS) without its rollouts and advantages "
                           "(manifests/generate.json, advantage.json); the window's update cannot take its batch")
    return batch

"""teacher-<name>: on-policy distillation's teacher scoring the student's samples routed to it
(docs/distillation.md), on the worker group where the teachers are loaded beside the student;
one task per teacher, so the Prefect run page shows each teacher's work."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.accumulation import version_of
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import committed, engine_of, group_of, say_retry, storage_of


@task(name="teacher", task_run_name="teacher-{teacher}", cache_policy=NO_CACHE, tags=["gpu"], retries=1,
      retry_delay_seconds=1, retry_condition_fn=say_retry)
def teach(recipe: Recipe, run_name: str, iteration: int, rollouts: list[str], teacher: str) -> dict[str, Any]:
    storage = storage_of(recipe, run_name)

    def make() -> dict[str, Any]:
        group = group_of(recipe, storage)
        engine_of(recipe, storage).release()  # colocated layout: the engine's memory is the group's now
        group.ensure(version_of(recipe, iteration))
        return group.call("teach", iteration=iteration, rollouts=rollouts, teacher=teacher,
                          out_dir=join(iter_dir(iteration), f"teacher-{teacher}"))

    return committed(storage, iteration, f"teacher-{teacher}", make)

"""generate: requests.arrow, then rollouts/part-*.arrow from the recipe's rollout engine; in async
RL the producer's committed batch of the iteration, admitted under the staleness bound."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.accumulation import version_of
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import committed, engine_of, producer_alive, say_retry, storage_of


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate(recipe: Recipe, run_name: str, iteration: int, round_index: int = 0) -> dict[str, Any]:
    """Round 0, or refill round `round_index` of dynamic sampling (files suffixed -rN)."""
    storage = storage_of(recipe, run_name)
    if recipe.rollout.mode == "async":
        from unirl.stages.run.async_rollout import collect  # start-up time: loaded on first use

        return committed(storage, iteration, "generate",
                            lambda: collect(storage, recipe, iteration, alive=producer_alive(storage)))
    suffix = it.round_suffix(round_index)
    requests = committed(
        storage, iteration, f"requests{suffix}", lambda: it.write_requests(storage, recipe, iteration, round_index)
    )

    def make() -> dict[str, Any]:
        out_dir = join(iter_dir(iteration), "rollouts" + (f"/r{round_index}" if round_index else ""))
        return engine_of(recipe, storage).generate(requests["files"][0], out_dir, iteration,
                                                   policy_version=version_of(recipe, iteration))

    return committed(storage, iteration, f"generate{suffix}", make)

"""evaluate: held-out accuracy of policy version `version` on a split (greedy, avg@k, pass@k)."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import eval_dir, eval_metrics, write_eval_requests
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.storage import join
from unirl.tasks.common import eval_engine_of, group_of, say_retry, storage_of


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    engine = eval_engine_of(recipe, storage)
    if engine.own_weights:
        engine.publish_for(group_of(recipe, storage), version)  # an engine loads what is published
    outputs = {}
    for name, size, greedy in (("greedy", 1, True), ("sampled", recipe.eval.k, False)):
        requests = write_eval_requests(storage, recipe, version, size, name, split)
        outputs[name] = engine.generate(requests, join(eval_dir(version, split), name), version, policy_version=version,
                                        greedy=greedy, seed_tag="eval")["files"]
    metrics = eval_metrics(storage, recipe, outputs["greedy"], outputs["sampled"], split)
    fault_point("evaluate", version)
    result = {"version": version, "metrics": metrics}
    storage.write_json(rel, result)
    return result

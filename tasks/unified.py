"""A unified model's own tasks (stages/compose/unified.py): each stage's generate on the one worker group
(plans from the user's prompts, images from the plans), compose, both stages' advantages in one
file, and held-out evaluation. Score, train and sync are the one-model tasks on the unified
recipe: its train step is the joint one."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.compose import pipeline
from unirl.stages.compose.unified import stage_recipe
from unirl.stages.recipe import Recipe
from unirl.stages.runtime import iteration as it
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import group_of, say_retry, storage_of
from unirl.tasks.pe import evaluate_composed

OUT = {"ar": ("generate", "plans"), "diffusion": ("generate-image", "images")}


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate_stage(recipe: Recipe, run_name: str, iteration: int, side: str, upstream: list[str] | None = None
                   ) -> dict[str, Any]:
    """The stage's requests and rollouts: the plans of the user's prompts (stage `generate`), or
    the images of the plans in `upstream` (stage `generate-image`), sampled by the weights of
    version `iteration`."""
    storage = storage_of(recipe, run_name)
    part = stage_recipe(recipe, side)
    if side == "ar":
        requests = it.committed(storage, iteration, "requests", lambda: it.write_requests(storage, part, iteration))
    else:
        rel = join(iter_dir(iteration), "image-requests.arrow")
        requests = it.committed(storage, iteration, "image-requests", lambda: pipeline.flow_requests(
            storage, list(upstream or []), storage, iteration, part.rollout.group_size, rel))
    stage, folder = OUT[side]

    def make() -> dict[str, Any]:
        group = group_of(recipe, storage)
        group.ensure(iteration)
        return group.call("generate", iteration=iteration, requests=requests["files"][0],
                          out_dir=join(iter_dir(iteration), "rollouts", folder), stage=side)

    return it.committed(storage, iteration, stage, make)


@task(name="compose", cache_policy=NO_CACHE)
def compose(recipe: Recipe, run_name: str, iteration: int, plans: list[str], images: list[str]) -> dict[str, Any]:
    """iter-N/rollouts/composed.arrow: one row per image with the plan that caused it."""
    storage = storage_of(recipe, run_name)
    rel = join(iter_dir(iteration), "rollouts", "composed.arrow")
    return it.committed(storage, iteration, "compose", lambda: pipeline.compose(storage, rel, storage, plans, storage, images))


@task(name="advantage", cache_policy=NO_CACHE)
def advantages(recipe: Recipe, run_name: str, iteration: int, composed: list[str], rewards: list[str]) -> dict[str, Any]:
    """iter-N/advantages.arrow: every plan's (among the plans of its prompt) and every image's
    (among the images of its plan), the rows the joint train step reads."""
    storage = storage_of(recipe, run_name)

    def make() -> dict[str, Any]:
        rows = pipeline.advantage_rows(recipe, storage, composed, rewards, list(pipeline.SIDES))
        rel = join(iter_dir(iteration), "advantages.arrow")
        write_shard(storage, rel, table_from_rows([r for side in pipeline.SIDES for r in rows[side]], "advantages"))
        return {"files": [rel], "rows": sum(len(v) for v in rows.values()), "metrics": pipeline.advantage_metrics(rows)}

    return it.committed(storage, iteration, "advantage", make)


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate_unified(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    """Held-out results at `version`: the greedy plan drawn by the ODE sampler, and `eval.k`
    sampled plans with one sampled image each, scored against the user's intent."""
    from unirl.stages.runtime.evaluation import eval_dir

    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    group = group_of(recipe, storage)

    def draw(side: str, requests: str, folder: str, greedy: bool) -> list[str]:
        group.ensure(version)
        return group.call("generate", iteration=version, requests=requests, out_dir=folder, greedy=greedy,
                          seed_tag="eval", stage=side)["files"]

    result = evaluate_composed(recipe, storage, version, stage_recipe(recipe, "ar"), {"ar": storage, "diffusion": storage},
                               draw, split)
    storage.write_json(rel, result)
    return result

"""The unified shape's Prefect side (stages/compose/unified.py): each stage's generate on the one
worker group (the first stage from the user's prompts, each later one from the texts of the stage
before it), compose, every stage's advantages in one file and the held-out evaluation, as tasks;
the `unified-iteration` flow; its one model and joint warm start. Score, train and sync are the
one-model tasks on the unified recipe: its train step is the joint one."""
from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from unirl.flows.forms import InnerRecipe
from unirl.flows.shapes import RunShape, iterate, one_model, run_shapes, train_and_sync, warm_start_one
from unirl.flows.shapes.composed import (
    chain,
    composed_eval_preview,
    composed_preview,
    composed_steps,
    evaluate_composed,
    nothing_early,
)
from unirl.stages.compose import names, upstream_of
from unirl.stages.compose.chain import advantage_metrics, advantage_rows, next_requests
from unirl.stages.compose.chain import compose as compose_rows
from unirl.stages.compose.unified import stage_recipe
from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.run.evaluation import eval_dir
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.tasks.common import committed, group_of, say_retry, storage_of
from unirl.tasks.console import say


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate_stage(recipe: Recipe, run_name: str, iteration: int, name: str, upstream: list[str] | None = None
                   ) -> dict[str, Any]:
    """Stage `name`'s requests and rollouts (stage `generate-<name>`, in rollouts/<name>): the
    first stage's of the user's prompts, a later stage's of the samples in `upstream` (the rollout
    files of the stage before it), sampled by the weights of version `iteration`."""
    storage = storage_of(recipe, run_name)
    part = stage_recipe(recipe, name)
    up = upstream_of(recipe, name)
    if up is None:
        requests = committed(storage, iteration, "requests", lambda: it.write_requests(storage, part, iteration))
    else:
        rel = join(iter_dir(iteration), f"requests-{name}.arrow")
        requests = committed(storage, iteration, f"requests-{name}", lambda: next_requests(
            storage, list(upstream or []), storage, iteration, part.rollout.group_size, rel))

    def make() -> dict[str, Any]:
        group = group_of(recipe, storage)
        group.ensure(iteration)
        return group.call("generate", iteration=iteration, requests=requests["files"][0],
                          out_dir=join(iter_dir(iteration), "rollouts", name), stage=name)

    return committed(storage, iteration, f"generate-{name}", make)


@task(name="compose", cache_policy=NO_CACHE)
def compose(recipe: Recipe, run_name: str, iteration: int, files: dict[str, list[str]]) -> dict[str, Any]:
    """iter-N/rollouts/composed.arrow: one row per last-stage sample with every stage's sample that led to it."""
    storage = storage_of(recipe, run_name)
    rel = join(iter_dir(iteration), "rollouts", "composed.arrow")
    stores = dict.fromkeys(names(recipe), storage)
    return committed(storage, iteration, "compose", lambda: compose_rows(storage, rel, chain(recipe, stores, files)))


@task(name="advantage", cache_policy=NO_CACHE)
def advantages(recipe: Recipe, run_name: str, iteration: int, composed: list[str], rewards: list[str]) -> dict[str, Any]:
    """iter-N/advantages.arrow: every stage's rows, each within its own groups (a plan's among the
    plans of its prompt, an image's among the images of its plan), which the joint train step reads."""
    storage = storage_of(recipe, run_name)

    def make() -> dict[str, Any]:
        rows = advantage_rows(recipe, storage, composed, rewards, names(recipe))
        rel = join(iter_dir(iteration), "advantages.arrow")
        write_shard(storage, rel, table_from_rows([r for name in names(recipe) for r in rows[name]], "advantages"))
        return {"files": [rel], "rows": sum(len(v) for v in rows.values()), "metrics": advantage_metrics(rows)}

    return committed(storage, iteration, "advantage", make)


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate_unified(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    """Held-out results at `version`: every stage's greedy sample (an image stage's by the ODE
    sampler), and `eval.k` samples of the first stage per prompt with one sample of each later
    stage each, scored against the user's intent."""
    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    group = group_of(recipe, storage)

    def draw(name: str, requests: str, folder: str, greedy: bool) -> list[str]:
        group.ensure(version)
        return group.call("generate", iteration=version, requests=requests, out_dir=folder, greedy=greedy,
                          seed_tag="eval", stage=name)["files"]

    first = names(recipe)[0]
    result = evaluate_composed(recipe, storage, version, stage_recipe(recipe, first), dict.fromkeys(names(recipe), storage),
                               draw, split)
    storage.write_json(rel, result)
    return result


@flow(name="unified-iteration", flow_run_name="{run_name}/iter-{iteration:06d}")
def unified_iteration(recipe: InnerRecipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    return iterate(recipe, run_name, iteration, lambda: composed_steps(
        recipe, run_name, iteration, generate_stage, compose, advantages,
        lambda rollouts, adv: train_and_sync(recipe, run_name, iteration, [f for n in names(recipe) for f in rollouts[n]],
                                             adv["files"][0])))


def warm_start_joint(recipe: Recipe, run_name: str, storage: RunStorage, tracker: Tracker) -> None:
    """The joint warm start of every stage (or the initial weights)."""
    if recipe.sft is not None:
        say(f"[unirl] warm start of {', '.join(names(recipe))} ({recipe.model.kind}, {recipe.sft.steps} joint steps)")
    warm_start_one(recipe, run_name, storage, tracker)


run_shapes.register("unified")(RunShape("unified", unified_iteration, evaluate_unified, one_model, nothing_early,
                                        warm_start_joint, composed_preview("plans"), composed_eval_preview))

"""The pipeline shape's Prefect side (stages/compose/pipeline.py): each part's generate (the first
from the user's prompts, each later one from the texts of the part before it), compose, the
per-part advantages and the held-out evaluation, as tasks; the `pe-iteration` flow; the models it
publishes (one per part, each its own run) and their warm starts. Score, train and sync are the
one-model tasks, run on the pipeline (score) or a part's recipe and run (train, sync), each under
its part's name in the flow run."""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from unirl.flows.forms import InnerRecipe
from unirl.flows.sft import run_sft
from unirl.flows.shapes import Models, RunShape, iterate, run_shapes
from unirl.flows.shapes.composed import (
    chain,
    composed_eval_preview,
    composed_preview,
    composed_steps,
    evaluate_composed,
    named,
    nothing_early,
)
from unirl.stages.compose import members, names, pipeline, upstream_of
from unirl.stages.compose.chain import compose as compose_rows
from unirl.stages.compose.chain import next_requests
from unirl.stages.compose.pipeline import PipelineConfig
from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.run.evaluation import eval_dir
from unirl.stages.run.record import initial_weights, open_run
from unirl.stages.run.sequence import Update, seconds
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.stages.workers.group import SharedGroup, share_group
from unirl.tasks.common import announce, committed, engine_of, say_retry, staged, storage_of
from unirl.tasks.console import say
from unirl.tasks.sync import sync
from unirl.tasks.train import train


def part_version(recipe: Recipe, name: str, iteration: int) -> int:
    """The weights version a part samples iteration `iteration` with: the iteration's (its train
    steps so far), or 0 for a frozen part."""
    return iteration if pipeline.trains(recipe, name) else 0


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate_part(recipe: Recipe, run_name: str, iteration: int, name: str, upstream: list[str] | None = None
                  ) -> dict[str, Any]:
    """The part's requests and rollouts, committed in the part's run: the first part's requests
    are the user's prompts; a later part's, one group per sample in `upstream` (the rollout files
    of the part before it)."""
    part = pipeline.part_recipe(recipe, name, run_name)
    storage = storage_of(part, name)
    up = upstream_of(recipe, name)
    if up is None:
        requests = committed(storage, iteration, "requests", lambda: it.write_requests(storage, part, iteration))
    else:
        rel = join(iter_dir(iteration), "requests.arrow")
        requests = committed(storage, iteration, "requests", lambda: next_requests(
            pipeline.part_storage(recipe, run_name, up), list(upstream or []), storage, iteration, part.rollout.group_size, rel))
    version = part_version(recipe, name, iteration)
    return committed(storage, iteration, "generate", lambda: engine_of(part, storage).generate(
        requests["files"][0], join(iter_dir(iteration), "rollouts"), iteration, policy_version=version))


@task(name="compose", cache_policy=NO_CACHE)
def compose(recipe: Recipe, run_name: str, iteration: int, files: dict[str, list[str]]) -> dict[str, Any]:
    """iter-N/rollouts/composed.arrow: one row per last-part sample with every part's sample that led to it."""
    storage = storage_of(recipe, run_name)
    stores = {n: pipeline.part_storage(recipe, run_name, n) for n in names(recipe)}
    rel = join(iter_dir(iteration), "rollouts", "composed.arrow")
    return committed(storage, iteration, "compose", lambda: compose_rows(storage, rel, chain(recipe, stores, files)))


@task(name="advantage", cache_policy=NO_CACHE)
def part_advantages(recipe: Recipe, run_name: str, iteration: int, composed: list[str], rewards: list[str]
                    ) -> dict[str, Any]:
    """Advantages of each trained part within its own groups, in the part's run."""
    storage = storage_of(recipe, run_name)
    parts = {n: pipeline.part_storage(recipe, run_name, n) for n in names(recipe) if pipeline.trains(recipe, n)}
    return committed(storage, iteration, "advantage",
                        lambda: pipeline.part_advantages(recipe, storage, iteration, composed, rewards, parts))


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate_pipeline(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    """Held-out results of the pipeline at `version` (each part at its own version: a frozen
    part's is 0): `greedy` is each part's greedy sample (a flow part's by the ODE sampler),
    `sampled` is `eval.k` samples of the first part per prompt and one sample of each later part
    each; both scored on the composed rows (eval/vNNNNNN/<name>/composed.arrow) by the eval
    scorer, against the user's intent."""
    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    parts = {n: pipeline.part_recipe(recipe, n, run_name) for n in names(recipe)}
    stores = {n: storage_of(part, n) for n, part in parts.items()}
    engines = {n: engine_of(part, stores[n]) for n, part in parts.items()}

    def draw(name: str, requests: str, folder: str, greedy: bool) -> list[str]:
        return engines[name].generate(requests, folder, version, policy_version=part_version(recipe, name, version),
                                      greedy=greedy, seed_tag="eval")["files"]

    result = evaluate_composed(recipe, storage, version, parts[names(recipe)[0]], stores, draw, split)
    storage.write_json(rel, result)
    return result


def pipeline_update(recipe: Recipe, run_name: str, iteration: int) -> Any:
    """Each trained part's train and sync, in the recipe's order, in the part's own run."""

    def update(rollouts: dict[str, list[str]], adv: dict[str, Any]) -> Update:
        done = Update({}, {})
        for name in [n for n in names(recipe) if n in adv["parts"]]:  # in the recipe's order (a manifest's keys are sorted)
            part = pipeline.part_recipe(recipe, name, run_name)
            trained = staged(named(train, name))(part, name, iteration, rollouts[name], adv["parts"][name])
            synced = staged(named(sync, name))(part, name, iteration)
            done.metrics.update({f"train/{name}/{k}": float(v) for k, v in trained["metrics"].items()})
            done.times.update({f"time/train_{name}_s": seconds(trained), f"time/sync_{name}_s": seconds(synced)})
        return done

    return update


@flow(name="pe-iteration", flow_run_name="{run_name}/iter-{iteration:06d}")
def pe_iteration(recipe: InnerRecipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    return iterate(recipe, run_name, iteration, lambda: composed_steps(
        recipe, run_name, iteration, generate_part, compose, part_advantages, pipeline_update(recipe, run_name, iteration)))


def pipeline_models(recipe: Recipe, run_name: str, storage: RunStorage) -> Models:
    """Each part's run, registered as `<recipe name>-<part>`."""
    return {f"{recipe.name}-{part.name}": (pipeline.part_storage(recipe, run_name, part.name), not part.freeze, part.model)
            for part in members(recipe)}


def warm_start_parts(recipe: Recipe, run_name: str, storage: RunStorage, tracker: Tracker) -> None:
    """Each part's warm start (or initial weights) in its own run; with `compose.placement:
    shared`, the one worker group that holds every part, which every task of a part then uses."""
    parts = {name: pipeline.part_recipe(recipe, name, run_name) for name in names(recipe)}
    stores = {}
    for name, part in parts.items():
        stores[name], _ = open_run(part, name)
        if part.sft is not None:
            say(f"[unirl] {name}: warm start ({part.model.kind}, {part.sft.steps} steps)")
            run_sft(part, stores[name])
        else:
            initial_weights(stores[name], part)
    if isinstance(recipe.compose, PipelineConfig) and recipe.compose.placement == "shared":
        shared = SharedGroup(storage, {name: (part, stores[name], stores[name].weights_rel(0)) for name, part in parts.items()},
                             log=announce(get_run_logger()))
        share_group({stores[name].url(): member for name, member in shared.members.items()})


run_shapes.register("pipeline")(RunShape("pipeline", pe_iteration, evaluate_pipeline, pipeline_models, nothing_early,
                                         warm_start_parts, composed_preview("rewrites"), composed_eval_preview))

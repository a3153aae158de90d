"""The shapes a run can have, as data for the one run loop (flows/rl.py `train_run`).

A shape says what differs between a single model, a prompt-enhancer pipeline (two models in
sequence, stages/compose/pipeline.py) and a unified model (one backbone, two losses,
stages/compose/unified.py): its iteration flow, its held-out evaluation task, the models it
publishes and registers, its warm start and what people see of its rollouts. Everything else
(resume, bookkeeping, held-out and test evaluation, artifacts, starting iterations ahead, closing
the worker groups) is the loop's, the same for every shape. A recipe's shape is `Recipe.shape`.

    single      rl-iteration:      generate -> score -> advantage -> train -> sync
    pipeline    pe-iteration:      generate-ar -> generate-diffusion -> compose -> score -> advantage
                                   -> train-<part>, sync-<part> for each part that trains
    unified     unified-iteration: generate-ar -> generate-diffusion -> compose -> score -> advantage
                                   -> train (one joint step) -> sync
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled, State

from unirl.flows.ahead import hand_over, wait_turn
from unirl.flows.console import say
from unirl.flows.sft import run_sft
from unirl.stages.compose import pipeline
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.run import initial_weights, open_run
from unirl.stages.runtime.storage import RunStorage, iter_dir
from unirl.stages.runtime.tracking import Tracker
from unirl.stages.workers.group import SharedGroup, share_group
from unirl.tasks.advantage import advantage
from unirl.tasks.common import announce, engine_of, group_of, staged
from unirl.tasks.evaluate import evaluate
from unirl.tasks.generate import generate
from unirl.tasks.pe import compose as compose_parts
from unirl.tasks.pe import evaluate_pipeline, generate_part, part_advantages
from unirl.tasks.score import score
from unirl.tasks.sync import sync
from unirl.tasks.train import train
from unirl.tasks.unified import advantages as stage_advantages
from unirl.tasks.unified import compose as compose_stages
from unirl.tasks.unified import evaluate_unified, generate_stage

# A registered model name -> (its run's storage, whether it trains, its `model` section): what a run publishes.
Models = dict[str, tuple[RunStorage, bool, Any]]


@dataclass(frozen=True)
class RunShape:
    name: str
    iteration: Callable[[Recipe, str, int], Any]  # the iteration's flow: its summary, or Cancelled
    evaluate: Any  # the held-out task: (recipe, run_name, version, split) -> {"metrics": ...}
    models: Callable[[Recipe, str, RunStorage], Models]
    prepare: Callable[[Recipe, RunStorage], None]  # before the warm start: engines and groups that can start early
    warm_start: Callable[[Recipe, str, RunStorage, Tracker], None]  # version 0 of every model
    preview: Callable[[Recipe, Tracker, RunStorage, int], str | None]  # an iteration's rollouts, for people
    eval_preview: Callable[[Recipe, Tracker, RunStorage, int], str | None]  # a held-out evaluation's samples


# -- single model --------------------------------------------------------------------------------


STAGES = ("generate", "score", "advantage", "train", "sync")


def stopped(run_name: str, iteration: int) -> State[Any]:
    """An iteration started ahead whose run stopped before its turn: it did nothing."""
    return Cancelled(message=f"run {run_name} stopped before {iter_dir(iteration)}'s turn; nothing was done")


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}")
def rl_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    if not wait_turn(run_name, iteration):  # started ahead (flows/ahead.py), and the run stopped meanwhile
        return stopped(run_name, iteration)
    start = time.perf_counter()
    generate_, score_, advantage_, train_, sync_ = staged(generate), staged(score), staged(advantage), staged(train), staged(sync)
    gen = generate_(recipe, run_name, iteration)
    scored = score_(recipe, run_name, iteration, gen["files"])
    rollouts, rewards, informative = list(gen["files"]), list(scored["files"]), scored["informative_groups"]
    ds = recipe.rollout.dynamic_sampling
    while ds is not None and informative < recipe.rollout.prompts_per_iteration and len(rewards) < ds.max_rounds:
        r = len(rewards)  # DAPO: refill with fresh prompts while too many groups carry no signal
        more = generate_(recipe, run_name, iteration, round_index=r)
        more_scored = score_(recipe, run_name, iteration, more["files"], round_index=r)
        rollouts += more["files"]
        rewards += more_scored["files"]
        informative += more_scored["informative_groups"]
    adv = advantage_(recipe, run_name, iteration, rewards)
    trained = train_(recipe, run_name, iteration, rollouts, adv["files"][0])
    synced = sync_(recipe, run_name, iteration)
    metrics: dict[str, float] = dict(gen.get("metrics", {}))  # async: staleness and what was dropped
    metrics.update(scored["metrics"])
    metrics.update(adv["metrics"])
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    for name, manifest in zip(STAGES, (gen, scored, adv, trained, synced)):
        metrics[f"time/{name}_s"] = float(manifest.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return hand_over(run_name, iteration, {
        "iteration": iteration, "policy_version": synced["policy_version"], "metrics": metrics,
        "checkpoint": synced.get("checkpoint"), "weights": synced.get("weights"),
    })


def one_model(recipe: Recipe, run_name: str, storage: RunStorage) -> Models:
    return {recipe.name: (storage, True, recipe.model)}


def prepare_one(recipe: Recipe, storage: RunStorage) -> None:
    from unirl.stages.runtime.storage import join
    from unirl.stages.train.manifests import MANIFEST

    if recipe.rollout.mode == "sync":
        engine_of(recipe, storage).connect()  # an engine at a URL that does not answer fails here, naming it
    if recipe.sft is None or storage.exists(join(storage.weights_rel(0), MANIFEST)):
        group_of(recipe, storage).prewarm()  # its imports overlap the setup that follows


def warm_start_one(recipe: Recipe, run_name: str, storage: RunStorage, tracker: Tracker) -> None:
    """The recipe's SFT (a unified model's: both stages, joint steps), or its initial weights."""
    if recipe.sft is None:
        initial_weights(storage, recipe)
        return
    if recipe.unified is not None:
        say(f"[unirl] warm start of both stages ({recipe.model.kind}, {recipe.sft.steps} joint steps)")
    run_sft(recipe, storage, tracker)


def policy_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, iteration: int) -> str | None:
    from unirl.stages.policies import policy_for

    return policy_for(recipe).log_preview(recipe, tracker, storage, iteration)


def policy_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    from unirl.stages.policies import policy_for

    return policy_for(recipe).log_eval_preview(recipe, tracker, storage, version)


# -- two models in sequence, or one backbone in two stages ----------------------------------------


# Each part's task under its own name in the flow run. Made once: `staged` keeps its untagged copy
# of a task by the task's identity, which a task made per call would not keep.
NAMED: dict[str, Any] = {f"{task.name}-{side}": task.with_options(name=f"{task.name}-{side}")
                         for task in (generate_part, train, sync) for side in pipeline.SIDES}
STAGE_NAMED: dict[str, Any] = {f"generate-{side}": generate_stage.with_options(name=f"generate-{side}") for side in pipeline.SIDES}


def composed_rollouts(recipe: Recipe, run_name: str, iteration: int, generate: dict[str, Any], compose: Any,
                      advantages: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """What a composed iteration does before it trains: each side's generate (the drawer's from the
    writer's outputs), the composed rows, their scores and each part's advantages. Returns the
    generates by side, the advantage manifest and the metrics so far."""
    first = staged(generate["generate-ar"])(recipe, run_name, iteration, "ar")
    second = staged(generate["generate-diffusion"])(recipe, run_name, iteration, "diffusion", first["files"])
    composed = staged(compose)(recipe, run_name, iteration, first["files"], second["files"])
    scored = staged(score)(recipe, run_name, iteration, composed["files"])
    adv = staged(advantages)(recipe, run_name, iteration, composed["files"], scored["files"])
    gens = {"ar": first, "diffusion": second}
    metrics: dict[str, float] = {**scored["metrics"], **adv["metrics"]}
    metrics.update({f"time/generate_{side}_s": float(gen.get("seconds", 0.0)) for side, gen in gens.items()})
    return gens, adv, metrics


@flow(name="pe-iteration", flow_run_name="iter-{iteration:06d}")
def pe_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    if not wait_turn(run_name, iteration):
        return stopped(run_name, iteration)
    start = time.perf_counter()
    gens, adv, metrics = composed_rollouts(recipe, run_name, iteration, NAMED, compose_parts, part_advantages)
    for side, rel in adv["parts"].items():
        part = pipeline.part_recipe(recipe, side, run_name)
        trained = staged(NAMED[f"train-{side}"])(part, side, iteration, gens[side]["files"], rel)
        synced = staged(NAMED[f"sync-{side}"])(part, side, iteration)
        metrics.update({f"train/{side}/{k}": float(v) for k, v in trained["metrics"].items()})
        metrics[f"time/train_{side}_s"] = float(trained.get("seconds", 0.0))
        metrics[f"time/sync_{side}_s"] = float(synced.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return hand_over(run_name, iteration, {"iteration": iteration, "metrics": metrics})


@flow(name="unified-iteration", flow_run_name="iter-{iteration:06d}")
def unified_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    if not wait_turn(run_name, iteration):
        return stopped(run_name, iteration)
    start = time.perf_counter()
    gens, adv, metrics = composed_rollouts(recipe, run_name, iteration, STAGE_NAMED, compose_stages, stage_advantages)
    rollouts = gens["ar"]["files"] + gens["diffusion"]["files"]
    trained = staged(train)(recipe, run_name, iteration, rollouts, adv["files"][0])
    synced = staged(sync)(recipe, run_name, iteration)
    metrics.update({f"train/{k}": float(v) for k, v in trained["metrics"].items()})
    metrics["time/train_s"] = float(trained.get("seconds", 0.0))
    metrics["time/sync_s"] = float(synced.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return hand_over(run_name, iteration, {"iteration": iteration, "policy_version": synced["policy_version"],
                                           "metrics": metrics, "checkpoint": synced.get("checkpoint"),
                                           "weights": synced.get("weights")})


def pipeline_models(recipe: Recipe, run_name: str, storage: RunStorage) -> Models:
    """Each part's run, registered as `<recipe name>-<side>`."""
    assert recipe.pe is not None
    return {f"{recipe.name}-{side}": (pipeline.part_storage(recipe, run_name, side), pipeline.trains(recipe, side),
                                      getattr(recipe.pe, side).model) for side in pipeline.SIDES}


def warm_start_parts(recipe: Recipe, run_name: str, storage: RunStorage, tracker: Tracker) -> None:
    """Each part's warm start (or initial weights) in its own run; with `pe.placement: shared`, the
    one worker group that holds both parts, which every task of a part then uses."""
    assert recipe.pe is not None
    parts = {side: pipeline.part_recipe(recipe, side, run_name) for side in pipeline.SIDES}
    stores = {}
    for side, part in parts.items():
        stores[side], _ = open_run(part, side)
        if part.sft is not None:
            say(f"[unirl] {side}: warm start ({part.model.kind}, {part.sft.steps} steps)")
            run_sft(part, stores[side])
        else:
            initial_weights(stores[side], part)
    if recipe.pe.placement == "shared":
        shared = SharedGroup(storage, {side: (part, stores[side], stores[side].weights_rel(0)) for side, part in parts.items()},
                             log=announce(get_run_logger()))
        share_group({stores[side].url(): member for side, member in shared.members.items()})


def nothing_early(recipe: Recipe, storage: RunStorage) -> None:
    return None


def composed_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, iteration: int) -> str | None:
    """The grid of the iteration's composed rollouts, each image captioned with the user's prompt,
    its text (rewrite or plan) and reward, and the table of every text beside its prompt and
    reward (tables/<rewrites|plans>/step-N.json)."""
    from unirl.stages.diffusion.grid import log_grid, rollout_grid

    composed_, scored = storage.stage_manifest(iteration, "compose"), storage.stage_manifest(iteration, "score")
    if composed_ is None or scored is None:
        return None  # not committed (a preview is for people)
    composed, rewards = composed_["files"], scored["files"][0]
    grid = log_grid(tracker, iteration, rollout_grid(storage, composed, rewards), "rollouts")
    tracker.log_table(iteration, text_table(storage, composed, rewards, grid), "rewrites" if recipe.pe else "plans")
    return grid


def text_table(storage: RunStorage, composed: list[str], rewards: str, grid: str) -> dict[str, list[Any]]:
    """Every composed row of an iteration as a table row: the user's prompt, the text beside it,
    the reward of its image, and the grid artifact that shows the first images."""
    from unirl.stages.runtime.sample import read_rollouts, read_shard, scoring_view

    table = scoring_view(read_rollouts(storage, composed, columns=["sample_id", "prompt", "text"]))
    shard = read_shard(storage, rewards, "rewards")
    reward = dict(zip(shard.column("sample_id").to_pylist(), shard.column("reward").to_pylist()))
    ids = table.column("sample_id").to_pylist()
    return {"sample_id": ids, "prompt": table.column("prompt").to_pylist(), "rewrite": table.column("text").to_pylist(),
            "reward": [reward[s] for s in ids], "grid": [grid] * len(ids)}


def composed_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    from unirl.stages.diffusion.grid import log_eval_grid

    return log_eval_grid(tracker, storage, version)


SHAPES: dict[str, RunShape] = {
    "single": RunShape("single", rl_iteration, evaluate, one_model, prepare_one, warm_start_one, policy_preview,
                       policy_eval_preview),
    "pipeline": RunShape("pipeline", pe_iteration, evaluate_pipeline, pipeline_models, nothing_early, warm_start_parts,
                         composed_preview, composed_eval_preview),
    "unified": RunShape("unified", unified_iteration, evaluate_unified, one_model, nothing_early, warm_start_one,
                        composed_preview, composed_eval_preview),
}


def shape_of(recipe: Recipe) -> RunShape:
    return SHAPES[recipe.shape]

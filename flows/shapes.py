"""The shapes a run can have, as data for the one run loop (flows/rl.py `train_run`).

A shape says what differs between a single model, a pipeline (models in sequence,
stages/compose/pipeline.py) and a unified model (one backbone in stages, one joint loss,
stages/compose/unified.py): its iteration flow, its held-out evaluation task, the models it
publishes and registers, its warm start and what people see of its rollouts. Everything else
(resume, bookkeeping, held-out and test evaluation, artifacts, starting iterations ahead, closing
the worker groups) is the loop's, the same for every shape. A recipe's shape is `Recipe.shape`;
a composed recipe's parts are named by it and run in its order.

    single      rl-iteration:      generate -> score -> advantage -> train -> sync
    pipeline    pe-iteration:      generate-<part> for each part in order -> compose -> score -> advantage
                                   -> train-<part>, sync-<part> for each part that trains
    unified     unified-iteration: generate-<stage> for each stage in order -> compose -> score -> advantage
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
from unirl.stages.compose import members, names, pipeline
from unirl.stages.recipe import PipelineConfig, Recipe
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
    if recipe.shape == "unified":
        say(f"[unirl] warm start of {', '.join(names(recipe))} ({recipe.model.kind}, {recipe.sft.steps} joint steps)")
    run_sft(recipe, storage, tracker)


def policy_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, iteration: int) -> str | None:
    from unirl.stages.policies import policy_for

    return policy_for(recipe).log_preview(recipe, tracker, storage, iteration)


def policy_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    from unirl.stages.policies import policy_for

    return policy_for(recipe).log_eval_preview(recipe, tracker, storage, version)


# -- two models in sequence, or one backbone in two stages ----------------------------------------


_NAMED: dict[str, Any] = {}


def named(task: Any, part: str) -> Any:
    """`task` under part `part`'s name in the flow run (`generate-<part>`). Made once per name:
    `staged` keeps its untagged copy of a task by the task's identity, which a task made per call
    would not keep."""
    key = f"{task.name}-{part}"
    if key not in _NAMED:
        _NAMED[key] = task.with_options(name=key)
    return _NAMED[key]


def composed_rollouts(recipe: Recipe, run_name: str, iteration: int, generate: Any, compose: Any,
                      advantages: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """What a composed iteration does before it trains: each part's generate in order (a later
    part's from the samples of the one before it), the composed rows, their scores and each
    part's advantages. Returns the generates by part, the advantage manifest and the metrics so far."""
    gens: dict[str, Any] = {}
    upstream: list[str] | None = None
    for name in names(recipe):
        gens[name] = staged(named(generate, name))(recipe, run_name, iteration, name, upstream)
        upstream = gens[name]["files"]
    composed = staged(compose)(recipe, run_name, iteration, {name: gen["files"] for name, gen in gens.items()})
    scored = staged(score)(recipe, run_name, iteration, composed["files"])
    adv = staged(advantages)(recipe, run_name, iteration, composed["files"], scored["files"])
    metrics: dict[str, float] = {**scored["metrics"], **adv["metrics"]}
    metrics.update({f"time/generate_{name}_s": float(gen.get("seconds", 0.0)) for name, gen in gens.items()})
    return gens, adv, metrics


@flow(name="pe-iteration", flow_run_name="iter-{iteration:06d}")
def pe_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    if not wait_turn(run_name, iteration):
        return stopped(run_name, iteration)
    start = time.perf_counter()
    gens, adv, metrics = composed_rollouts(recipe, run_name, iteration, generate_part, compose_parts, part_advantages)
    for name in [n for n in names(recipe) if n in adv["parts"]]:  # in the recipe's order (a manifest's keys are sorted)
        rel = adv["parts"][name]
        part = pipeline.part_recipe(recipe, name, run_name)
        trained = staged(named(train, name))(part, name, iteration, gens[name]["files"], rel)
        synced = staged(named(sync, name))(part, name, iteration)
        metrics.update({f"train/{name}/{k}": float(v) for k, v in trained["metrics"].items()})
        metrics[f"time/train_{name}_s"] = float(trained.get("seconds", 0.0))
        metrics[f"time/sync_{name}_s"] = float(synced.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return hand_over(run_name, iteration, {"iteration": iteration, "metrics": metrics})


@flow(name="unified-iteration", flow_run_name="iter-{iteration:06d}")
def unified_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    if not wait_turn(run_name, iteration):
        return stopped(run_name, iteration)
    start = time.perf_counter()
    gens, adv, metrics = composed_rollouts(recipe, run_name, iteration, generate_stage, compose_stages, stage_advantages)
    rollouts = [f for gen in gens.values() for f in gen["files"]]
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
    tracker.log_table(iteration, text_table(storage, composed, rewards, grid), "rewrites" if recipe.shape == "pipeline" else "plans")
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

"""The shapes a run can have, as data for the one run loop (flows/rl.py `train_run`).

A shape says what differs between a single model and the composed shapes (stages/compose/): its
iteration flow, its held-out evaluation task, the models it publishes and registers, its warm
start and what people see of its rollouts. Everything else (resume, bookkeeping, held-out and test
evaluation, artifacts, starting iterations ahead, closing the worker groups) is the loop's, the
same for every shape. A recipe's shape is `Recipe.shape`: `single`, or its `compose.kind`, whose
Prefect side (tasks, iteration flow, `RunShape`) is one module of this package registered under
that name (pipeline.py, unified.py); a composed recipe's parts are named by it and run in its order.

    single      rl-iteration:      generate -> score -> [teacher-<name> per teacher] -> advantage -> train -> sync
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

from prefect import flow
from prefect.states import Cancelled, State

from unirl.flows.ahead import hand_over, wait_turn
from unirl.flows.forms import InnerRecipe
from unirl.flows.sft import run_sft, train_teachers
from unirl.stages.distill import taught_by
from unirl.stages.recipe import Recipe
from unirl.stages.run.record import initial_weights
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.registry import Registry
from unirl.stages.runtime.storage import RunStorage, iter_dir
from unirl.tasks.advantage import advantage
from unirl.tasks.common import engine_of, group_of, staged
from unirl.tasks.evaluate import evaluate
from unirl.tasks.generate import generate
from unirl.tasks.score import score
from unirl.tasks.sync import sync
from unirl.tasks.teach import teach
from unirl.tasks.train import train

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
def rl_iteration(recipe: InnerRecipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
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
    taught = [staged(teach)(recipe, run_name, iteration, rollouts, t) for t in taught_by(recipe)]  # distillation's teachers
    adv = advantage_(recipe, run_name, iteration, rewards, rollouts, [f for t in taught for f in t["files"]])
    trained = train_(recipe, run_name, iteration, rollouts, adv["files"][0])
    synced = sync_(recipe, run_name, iteration)
    metrics: dict[str, float] = dict(gen.get("metrics", {}))  # async: staleness and what was dropped
    metrics.update(scored["metrics"])
    metrics.update(adv["metrics"])
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    for name, manifest in zip(STAGES, (gen, scored, adv, trained, synced)):
        metrics[f"time/{name}_s"] = float(manifest.get("seconds", 0.0))
    if taught:
        metrics["time/teacher_s"] = float(sum(t.get("seconds", 0.0) for t in taught))
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
    """The teachers it trains (`distill.teachers[].sft`) from the base model, then the recipe's SFT
    (or its initial weights), then the teachers that start from the student's initial weights."""
    train_teachers(recipe, run_name, tracker)
    if recipe.sft is None:
        initial_weights(storage, recipe)
    else:
        run_sft(recipe, storage, tracker)
    train_teachers(recipe, run_name, tracker, init="student")


def policy_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, iteration: int) -> str | None:
    from unirl.stages.policies import policy_for

    return policy_for(recipe).log_preview(recipe, tracker, storage, iteration)


def policy_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    from unirl.stages.policies import policy_for

    if recipe.agent is not None:  # an agent's held-out trajectories, as chats
        return agent_transcripts(tracker, storage, version)
    return policy_for(recipe).log_eval_preview(recipe, tracker, storage, version)


def agent_transcripts(tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    """MLflow `tables/transcripts/step-<version>.json`: the first greedy held-out trajectories of
    `version`, each rendered as a chat with its stop reason and reference answer."""
    import json

    from unirl.stages.run.evaluation import eval_dir
    from unirl.stages.runtime.sample import read_rollouts, read_shard
    from unirl.stages.runtime.storage import join
    from unirl.stages.tools.agent import transcript_table

    base = join(eval_dir(version), "greedy")
    rel = f"{base}.turns/transcript.arrow"
    if not storage.exists(rel):
        return None
    rows = read_rollouts(storage, [join(base, "part-000.arrow")], columns=["sample_id", "prompt", "metadata"])  # AgentEngine's shard
    prompts = dict(zip(rows.column("sample_id").to_pylist(), rows.column("prompt").to_pylist()))
    answers = {s: json.loads(m or "{}").get("answer") for s, m in zip(rows.column("sample_id").to_pylist(),
                                                                        rows.column("metadata").to_pylist())}
    return tracker.log_table(version, transcript_table(read_shard(storage, rel, "turns"), prompts, answers), "transcripts")


run_shapes: Registry[RunShape] = Registry("run shape", "unirl.flows.shapes", "compose.kind")
run_shapes.register("single")(RunShape("single", rl_iteration, evaluate, one_model, prepare_one, warm_start_one,
                                       policy_preview, policy_eval_preview))


def shape_of(recipe: Recipe) -> RunShape:
    return run_shapes.get(recipe.shape)

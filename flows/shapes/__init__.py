"""The shapes a run can have, as data for the one run loop (flows/rl.py `train_run`).

A shape says what differs between a single model and the composed shapes (stages/compose/): its
iteration flow (the steps it hands to the one iteration sequence, stages/run/sequence.py), its
held-out evaluation task, the models it publishes and registers, its warm start and what people
see of its rollouts. Everything else (resume, held-out and test evaluation, the run's events and
their readers, starting iterations ahead, closing the worker groups) is the loop's, the same for
every shape. A recipe's shape is `Recipe.shape`: `single`, or its `compose.kind`, whose
Prefect side (tasks, iteration flow, `RunShape`) is one module of this package registered under
that name (pipeline.py, unified.py); a composed recipe's parts are named by it and run in its order.
An iteration's flow run is named `<run>/iter-NNNNNN`; each task logs one line of what it did and
the iteration's flow run its metric line.

    single      rl-iteration:      generate -> score -> [teacher-<name> per teacher] -> advantage -> train -> sync
    pipeline    pe-iteration:      generate-<part> for each part in order -> compose -> score -> advantage
                                   -> train-<part>, sync-<part> for each part that trains
    unified     unified-iteration: generate-<stage> for each stage in order -> compose -> score -> advantage
                                   -> train (one joint step) -> sync
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled, State

from unirl.flows.ahead import hand_over, wait_turn
from unirl.flows.forms import InnerRecipe
from unirl.flows.sft import run_sft, train_teachers
from unirl.stages.distill import taught_by
from unirl.stages.policies import policy_for
from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import eval_dir
from unirl.stages.run.record import initial_weights
from unirl.stages.run.sequence import Batch, Steps, Update, run_iteration, seconds
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.registry import Registry
from unirl.stages.runtime.sample import read_rollouts, read_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.stages.tools.agent import transcript_table
from unirl.stages.train.manifests import MANIFEST
from unirl.tasks.advantage import advantage
from unirl.tasks.common import engine_of, group_of, staged
from unirl.tasks.console import iteration_line
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


def stopped(run_name: str, iteration: int) -> State[Any]:
    """An iteration started ahead whose run stopped before its turn: it did nothing."""
    return Cancelled(message=f"run {run_name} stopped before {iter_dir(iteration)}'s turn; nothing was done")


def single_steps(recipe: Recipe, run_name: str, iteration: int) -> Steps:
    """The single model's steps: its Prefect tasks."""
    generate_, score_ = staged(generate), staged(score)

    def generate_round(r: int) -> Batch:
        gen = generate_(recipe, run_name, iteration, **({"round_index": r} if r else {}))
        return Batch(list(gen["files"]), {"": list(gen["files"])}, dict(gen.get("metrics", {})),
                     {"time/generate_s": seconds(gen)})

    def teach_(rollouts: list[str]) -> list[dict[str, Any]]:
        return [staged(teach)(recipe, run_name, iteration, rollouts, t) for t in taught_by(recipe)]

    return Steps(
        generate=generate_round,
        score=lambda files, r: score_(recipe, run_name, iteration, files, **({"round_index": r} if r else {})),
        advantage=lambda rewards, rollouts, taught: staged(advantage)(recipe, run_name, iteration, rewards, rollouts, taught),
        update=lambda rollouts, adv: train_and_sync(recipe, run_name, iteration, rollouts[""], adv["files"][0]),
        teach=teach_)


def train_and_sync(recipe: Recipe, run_name: str, iteration: int, rollouts: list[str], advantages: str) -> Update:
    """One model's update: its train task on `rollouts`, then its sync task."""
    trained = staged(train)(recipe, run_name, iteration, rollouts, advantages)
    synced = staged(sync)(recipe, run_name, iteration)
    return Update({f"train/{k}": float(v) for k, v in trained["metrics"].items()},
                  {"time/train_s": seconds(trained), "time/sync_s": seconds(synced)},
                  {"policy_version": synced["policy_version"], "checkpoint": synced.get("checkpoint"),
                   "weights": synced.get("weights")})


def iterate(recipe: Recipe, run_name: str, iteration: int, steps: Callable[[], Steps]) -> dict[str, Any] | State[Any]:
    """An iteration flow's body: its turn (flows/ahead.py), the sequence through `steps`, its hand-over."""
    if not wait_turn(run_name, iteration):  # started ahead, and the run stopped meanwhile
        return stopped(run_name, iteration)
    summary = run_iteration(recipe, iteration, steps())
    get_run_logger().info(iteration_line(iteration, recipe.iterations, summary["metrics"]))  # the subflow's own page says it
    return hand_over(run_name, iteration, summary)


@flow(name="rl-iteration", flow_run_name="{run_name}/iter-{iteration:06d}")
def rl_iteration(recipe: InnerRecipe, run_name: str, iteration: int) -> dict[str, Any] | State[Any]:
    return iterate(recipe, run_name, iteration, lambda: single_steps(recipe, run_name, iteration))


def one_model(recipe: Recipe, run_name: str, storage: RunStorage) -> Models:
    return {recipe.name: (storage, True, recipe.model)}


def prepare_one(recipe: Recipe, storage: RunStorage) -> None:
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
    return policy_for(recipe).log_preview(recipe, tracker, storage, iteration)


def policy_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    if recipe.agent is not None:  # an agent's held-out trajectories, as chats
        return agent_transcripts(tracker, storage, version)
    return policy_for(recipe).log_eval_preview(recipe, tracker, storage, version)


def agent_transcripts(tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    """MLflow `tables/transcripts/step-<version>.json`: the first greedy held-out trajectories of
    `version`, each rendered as a chat with its stop reason and reference answer."""

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

"""A prompt-enhancer run (a recipe with `pe:`) as Prefect flows: `rl-train` runs it (flows/rl.py
hands over here), one `pe-iteration` flow run per iteration whose task runs are each part's:

    generate-ar -> generate-diffusion -> compose -> score -> advantage
        -> train-ar, train-diffusion (the parts that train) -> sync-ar, sync-diffusion

Each part is a one-model run of its own under `{run}/parts/<side>` (stages/compose/pipeline.py): its warm
start, checkpoints and weights versions, and its worker group (`pe.placement: separate`) or its
member of one group that holds both (`shared`). The pipeline run's folder holds the composed
rollouts, the rewards, the held-out results and `_SUCCESS` per iteration; a run resumes after
its last finished iteration, and every task returns its committed output instead of redoing it.
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.settings import temporary_settings

from unirl.flows.console import Progress, log_to_run_folder, say
from unirl.flows.evaluate import report_test, summary, test_split
from unirl.flows.sft import run_sft
from unirl.stages.compose import pipeline
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.run import initial_weights, open_run, update_run_info
from unirl.stages.runtime.storage import iter_dir, join
from unirl.stages.runtime.tracking import Tracker
from unirl.stages.train.manifests import MANIFEST
from unirl.stages.workers.group import SharedGroup, close_group, share_group
from unirl.tasks.common import announce, close_engine, run_tags, staged, storage_of
from unirl.tasks.pe import compose, evaluate_pipeline, generate_part, part_advantages
from unirl.tasks.score import score
from unirl.tasks.sync import sync
from unirl.tasks.train import train

# Each part's task under its own name in the flow run. Made once: `staged` keeps its untagged copy
# of a task by the task's identity, which a task made per call would not keep.
NAMED = {f"{task.name}-{side}": task.with_options(name=f"{task.name}-{side}")
         for task in (generate_part, train, sync) for side in pipeline.SIDES}


def named(name: str) -> Any:
    return staged(NAMED[name])


@flow(name="pe-iteration", flow_run_name="iter-{iteration:06d}")
def pe_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    start = time.perf_counter()
    rewrites = named("generate-ar")(recipe, run_name, iteration, "ar")
    images = named("generate-diffusion")(recipe, run_name, iteration, "diffusion", rewrites["files"])
    composed = staged(compose)(recipe, run_name, iteration, rewrites["files"], images["files"])
    scored = staged(score)(recipe, run_name, iteration, composed["files"])
    adv = staged(part_advantages)(recipe, run_name, iteration, composed["files"], scored["files"])
    metrics: dict[str, float] = {**scored["metrics"], **adv["metrics"]}
    gens = {"ar": rewrites, "diffusion": images}
    for side in pipeline.SIDES:
        metrics[f"time/generate_{side}_s"] = float(rewrites.get("seconds", 0.0) if side == "ar" else images.get("seconds", 0.0))
    for side, rel in adv["parts"].items():
        part = pipeline.part_recipe(recipe, side, run_name)
        trained = named(f"train-{side}")(part, side, iteration, gens[side]["files"], rel)
        synced = named(f"sync-{side}")(part, side, iteration)
        metrics.update({f"train/{side}/{k}": float(v) for k, v in trained["metrics"].items()})
        metrics[f"time/train_{side}_s"] = float(trained.get("seconds", 0.0))
        metrics[f"time/sync_{side}_s"] = float(synced.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return {"iteration": iteration, "metrics": metrics}


def pe_run(recipe: Recipe, run_name: str) -> dict[str, Any]:
    """The body of `rl_train` for a pipeline recipe, under the run's lease."""
    parts = {side: pipeline.part_recipe(recipe, side, run_name) for side in pipeline.SIDES}

    def warm_start(storage: Any, tracker: Tracker) -> dict[str, Any]:
        stores = {}
        for side, part in parts.items():
            stores[side], _ = open_run(part, side)
            if part.sft is not None:
                say(f"[unirl] {side}: warm start ({part.model.kind}, {part.sft.steps} steps)")
                run_sft(part, stores[side])
            else:
                initial_weights(stores[side], part)
        if recipe.pe.placement == "shared":  # one worker group holds both parts: every task of a part uses its member
            shared = SharedGroup(storage, {side: (part, stores[side], stores[side].weights_rel(0)) for side, part in parts.items()},
                                 log=announce(get_run_logger()))
            share_group({stores[side].url(): member for side, member in shared.members.items()})
        return {f"{recipe.name}-{side}": (store, pipeline.trains(recipe, side)) for side, store in zip(parts, stores.values())}

    return run_stages(recipe, run_name, warm_start, pe_iteration, evaluate_pipeline, "rewrites")


def run_stages(recipe: Recipe, run_name: str, warm_start: Any, iteration_flow: Any, evaluate: Any,
               table: str) -> dict[str, Any]:
    """What a prompt-enhancer pipeline and a unified model share around their iterations: the warm
    start (`warm_start(storage, tracker)` -> {registered model name: (run storage, whether it
    trains)}), the resume after the last finished iteration, `iteration_flow` per iteration,
    held-out evaluation (`evaluate`, a task of (recipe, run_name, version, split)), MLflow metrics,
    weights versions in the registry and previews (the rollout grid and the `table` of texts)."""
    logger = get_run_logger()
    storage, info = open_run(recipe, run_name)
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    if info.get("mlflow_run_id") != tracker.run_id:
        update_run_info(storage, mlflow_run_id=tracker.run_id)
    stores: dict[str, Any] = {}
    progress: Progress | None = None
    try:
        stores = warm_start(storage, tracker)
        register(recipe, tracker, run_name, stores, 0)
        first = storage.last_success() + 1
        if first > 0:
            logger.info("resuming %s at %s", storage.url(), iter_dir(first))
        for i in range(first):  # committed by a killed run before it reported them
            if not tracker.has_step(i):
                register(recipe, tracker, run_name, stores, i + 1)
                tracker.log_metrics(i, storage.read_json(join(iter_dir(i), "_SUCCESS"))["metrics"])
        log_file = log_to_run_folder(storage.local_path())
        say(f"[unirl] run {run_name} at {storage.url()}  (MLflow {tracker.link()})"
            + (f"\n[unirl] log: {log_file}" if log_file else ""))
        progress = Progress(recipe.iterations, first)
        evals: dict[int, dict[str, float]] = {}
        with run_tags(recipe, run_name), temporary_settings(updates={"flows.heartbeat_frequency": None}):
            tested = None
            if recipe.eval.enabled:
                evals[0] = held_out(recipe, run_name, 0, tracker, "before RL", evaluate)
                tested = test_split(recipe, run_name, 0, evaluate, compute=first == 0)  # reported after RL
            for i in range(first, recipe.iterations):
                summary = iteration_flow(recipe, run_name, i)
                progress.iteration(i, summary["metrics"])  # before its evaluation: the console reads top to bottom
                version = i + 1
                if (recipe.eval.every and version % recipe.eval.every == 0) or (
                    recipe.eval.enabled and version == recipe.iterations
                ):
                    evals[version] = held_out(recipe, run_name, version, tracker,
                                              "after RL" if version == recipe.iterations else "", evaluate)
                    if version == recipe.iterations:
                        report_test(recipe, run_name, tracker, tested, version, evaluate)
                storage.mark_success(i, summary)
                register(recipe, tracker, run_name, stores, version)
                tracker.log_metrics(i, summary["metrics"])
                preview(recipe, tracker, storage, i, table)
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        if progress is not None:
            progress.close()
        for store, _ in stores.values():
            close_engine(store.url())
            close_group(store.url())
    tracker.finish()
    return {"run": run_name, "storage": storage.url(), "iterations": recipe.iterations,
            "mlflow_run_id": tracker.run_id, "eval": {str(k): v for k, v in evals.items()}}


def register(recipe: Recipe, tracker: Tracker, run_name: str, stores: dict[str, Any], version: int) -> None:
    """Each model's published weights `version` as a version of its registered model in MLflow
    (`tracking.registry`; a pipeline's parts as `<recipe name>-<side>`); a model publishes every
    `checkpoint_every` iterations and a frozen one only v000000."""
    if not recipe.tracking.registry:
        return
    for name, (store, trains) in stores.items():
        rel = store.weights_rel(version)
        if (version == 0 or trains) and store.exists(join(rel, MANIFEST)):
            tracker.register_version(name, run_name, version, store.url(rel), store.read_json(join(rel, MANIFEST)))


def held_out(recipe: Recipe, run_name: str, version: int, tracker: Tracker, label: str, evaluate: Any) -> dict[str, float]:
    """The model on the held-out prompts at `version` (a frozen part at v000000): greedy text
    then ODE image, and `eval.k` sampled texts with one sampled image each."""
    m = staged(evaluate)(recipe, run_name, version)["metrics"]
    say(f"[unirl] held-out v{version:06d}{' (' + label + ')' if label else ''}: {summary(recipe, m)}")
    tracker.log_metrics(version, m, key="eval/accuracy")
    try:
        from unirl.stages.diffusion.grid import log_eval_grid

        log_eval_grid(tracker, storage_of(recipe, run_name), version)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("held-out preview of v%06d not logged: %s", version, exc)
    return m


def rewrite_table(storage: Any, composed: list[str], rewards: str, grid: str) -> dict[str, list[Any]]:
    """Every composed row of an iteration as a table row: the user's prompt, the rewrite beside it,
    the reward of its image, and the grid artifact that shows the first images."""
    from unirl.stages.runtime.sample import read_rollouts, read_shard, scoring_view

    table = scoring_view(read_rollouts(storage, composed, columns=["sample_id", "prompt", "text"]))
    shard = read_shard(storage, rewards, "rewards")
    reward = dict(zip(shard.column("sample_id").to_pylist(), shard.column("reward").to_pylist()))
    ids = table.column("sample_id").to_pylist()
    return {"sample_id": ids, "prompt": table.column("prompt").to_pylist(), "rewrite": table.column("text").to_pylist(),
            "reward": [reward[s] for s in ids], "grid": [grid] * len(ids)}


def preview(recipe: Recipe, tracker: Tracker, storage: Any, iteration: int, table: str = "rewrites") -> None:
    """Every `tracking.preview_every` iterations: the grid of composed rollouts, each image captioned
    with the user's prompt, the text (rewrite or plan) and the reward, and the table of every text
    beside its prompt and reward (tables/<table>/step-N.json)."""
    every = recipe.tracking.preview_every
    if not every or iteration % every:
        return
    try:
        from unirl.stages.diffusion.grid import log_grid, rollout_grid

        composed = storage.stage_manifest(iteration, "compose")["files"]
        rewards = storage.stage_manifest(iteration, "score")["files"][0]
        grid = log_grid(tracker, iteration, rollout_grid(storage, composed, rewards), "rollouts")
        tracker.log_table(iteration, rewrite_table(storage, composed, rewards, grid), table)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("rollout preview of %s not logged: %s", iter_dir(iteration), exc)


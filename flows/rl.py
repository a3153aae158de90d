"""The RL training run as Prefect flows: one `rl-train` flow run for the whole run, and one
`rl-iteration` flow run per iteration (named iter-000007) whose tasks are the five stages.

generate -> score -> advantage -> train -> sync, then `_SUCCESS`. A run resumes after its last
finished iteration; every stage returns its committed output instead of recomputing it.
"""
from __future__ import annotations

import os
import time
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.settings import temporary_settings
from prefect.states import Cancelled
from pydantic import Field

from unirl.flows.ahead import Ahead, hand_over, wait_turn
from unirl.flows.artifacts import RunArtifacts
from unirl.flows.bookkeeping import Bookkeeping
from unirl.flows.console import Progress, log_to_run_folder, say
from unirl.flows.evaluate import eval_artifact, report_test, summary, test_split
from unirl.flows.hooks import stop_worker_group
from unirl.flows.sft import run_sft
from unirl.stages.policies import policy_for
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.evaluation import eval_dir
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.lease import RunLease
from unirl.stages.runtime.run import initial_weights, open_run, update_run_info
from unirl.stages.runtime.storage import iter_dir, join
from unirl.stages.runtime.tracking import Tracker
from unirl.stages.train.manifests import MANIFEST
from unirl.stages.workers.group import close_group
from unirl.tasks.advantage import advantage
from unirl.tasks.common import close_engine, engine_of, group_of, run_tags, staged, start_producer, stop_producer, storage_of
from unirl.tasks.evaluate import evaluate
from unirl.tasks.generate import generate
from unirl.tasks.score import score
from unirl.tasks.sync import sync
from unirl.tasks.train import train

STAGES = ("generate", "score", "advantage", "train", "sync")


def starts_ahead() -> bool:
    """Whether each iteration's flow run starts while the previous one works (flows/ahead.py), by
    UNIRL_OVERLAP_ITERATIONS: "on" (the default) or "off". Measured on 2 CPU cores, where the
    start's API work shares the cores with the model, it still pays: 215-255 against 277-308 ms
    per quickstart iteration (benchmarks/README.md); on a GPU host it is hidden entirely."""
    mode = os.environ.get("UNIRL_OVERLAP_ITERATIONS", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"UNIRL_OVERLAP_ITERATIONS={mode!r}: use on or off")
    return mode == "on"


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}")
def rl_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    if not wait_turn(run_name, iteration):  # started ahead (flows/ahead.py), and the run stopped meanwhile
        return Cancelled(message=f"run {run_name} stopped before {iter_dir(iteration)}'s turn; nothing was done")
    start = time.perf_counter()
    generate_, score_, advantage_, train_, sync_ = (staged(t) for t in (generate, score, advantage, train, sync))
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


@flow(name="rl-train", flow_run_name="{recipe.name}/{run_name}",
      on_cancellation=[stop_worker_group], on_crashed=[stop_worker_group])
def rl_train(
    recipe: Recipe, run_name: str = "", iterations: Annotated[int | None, Field(ge=1)] = None
) -> dict[str, Any]:
    """Run (or resume) `recipe` as run `run_name` (default: the recipe's name).

    Args:
        recipe: The whole run: model, data, rollout, reward, algorithm, training, storage.
        run_name: Run folder name (default: the recipe's name); the same name resumes the run.
        iterations: Overrides `recipe.iterations` (e.g. `--param iterations=2`); more than the
            run has finished extends it.
    """
    run_name = run_name or recipe.name
    if iterations is not None:
        recipe = recipe.model_copy(update={"iterations": iterations})
    build_prompt_source(recipe.data)  # a bad data file fails here, before any model loads
    lease = RunLease(storage_of(recipe, run_name), log=lambda m: say(f"[unirl] {m}")).acquire()  # one owner per run
    try:
        if recipe.pe is not None:
            from unirl.flows.pe import pe_run

            return pe_run(recipe, run_name)
        if recipe.unified is not None:
            from unirl.flows.unified import unified_run

            return unified_run(recipe, run_name)
        return train_run(recipe, run_name)
    finally:
        lease.release()


def train_run(recipe: Recipe, run_name: str) -> dict[str, Any]:
    """The body of `rl_train`, under the run's lease."""
    logger = get_run_logger()
    storage, info = open_run(recipe, run_name)
    if recipe.rollout.mode == "sync":
        engine_of(recipe, storage).connect()  # an engine at a URL that does not answer fails here, naming it
    if recipe.sft is None or storage.exists(join(storage.weights_rel(0), MANIFEST)):
        group_of(recipe, storage).prewarm()  # its imports overlap the setup below
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    if info.get("mlflow_run_id") != tracker.run_id:
        info = update_run_info(storage, mlflow_run_id=tracker.run_id)
    if recipe.sft is not None:
        run_sft(recipe, storage, tracker)
    else:
        initial_weights(storage, recipe)
    register(recipe, tracker, storage, run_name, 0)
    first = storage.last_success() + 1
    if first > 0:
        logger.info("resuming %s at %s", storage.url(), iter_dir(first))
    log_file = log_to_run_folder(storage.local_path())
    say(f"[unirl] run {run_name} at {storage.url()}  (MLflow {tracker.link()})"
        + (f"\n[unirl] log: {log_file}" if log_file else ""))
    last: dict[str, Any] = {}
    artifacts = RunArtifacts(recipe, run_name, storage, tracker)
    artifacts.start(first)
    caught = catch_up(recipe, tracker, storage, run_name, first)
    if caught:
        say(f"[unirl] {', '.join(iter_dir(i) for i in caught)}: committed but not reported by the killed run; reported now")
    progress = Progress(recipe.iterations, first)
    evals: dict[int, dict[str, float]] = {}
    books = Bookkeeping()  # MLflow, previews, the registry, progress: off the critical path
    ahead = Ahead(run_name, recipe.iterations, lambda i: rl_iteration(recipe, run_name, i))
    overlap = starts_ahead()
    try:
        # The run's own flow run keeps its heartbeat (started with it); one per iteration flow run
        # would cost up to a second each (Prefect joins a heartbeat thread that sleeps in 1 s
        # steps). Entered once: building the settings costs 30 ms.
        with run_tags(recipe, run_name), temporary_settings(updates={"flows.heartbeat_frequency": None}):
            if recipe.rollout.mode == "async" and first < recipe.iterations:
                start_producer(recipe, run_name, storage)  # samples ahead while the trainer trains
            tested = None
            if recipe.eval.enabled:
                evals[0] = held_out(recipe, run_name, 0, tracker, "before RL", books)
                tested = test_split(recipe, run_name, 0, evaluate, compute=first == 0)  # reported after RL
            for i in range(first, recipe.iterations):
                summary = ahead.take(i) if overlap else rl_iteration(recipe, run_name, i)
                progress.iteration(i, summary["metrics"])  # before its evaluation: the console reads top to bottom
                version = i + 1
                if summary.get("weights"):
                    books.submit(register, recipe, tracker, storage, run_name, version)
                if (recipe.eval.every and version % recipe.eval.every == 0) or (
                    recipe.eval.enabled and version == recipe.iterations
                ):
                    label = "after RL" if version == recipe.iterations else ""
                    evals[version] = held_out(recipe, run_name, version, tracker, label, books)
                    if label:
                        report_test(recipe, run_name, tracker, tested, version, evaluate)
                storage.mark_success(i, summary)
                books.submit(report, recipe, tracker, storage, artifacts, i, summary)
                last = summary
        ahead.close()  # the last flow run's end
        books.close()
    except BaseException:
        for end in (ahead.close, books.close):
            try:
                end()
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
                logger.warning("ending the run after the failure also failed: %s: %s", type(exc).__name__, exc)
        tracker.finish("FAILED")
        artifacts.publish_table()
        raise
    finally:
        progress.close()
        stop_producer(storage.url())
        close_engine(storage.url())
        close_group(storage.url())
    tracker.finish()
    artifacts.finish()
    return {"run": run_name, "storage": storage.url(), "iterations": recipe.iterations,
            "last": last, "mlflow_run_id": tracker.run_id, "eval": {str(k): v for k, v in evals.items()}}


def report(recipe: Recipe, tracker: Tracker, storage: Any, artifacts: RunArtifacts, iteration: int,
           summary: dict[str, Any]) -> None:
    """What a committed iteration reports (on the bookkeeping thread): its metrics to MLflow, its
    rollout preview, its row in the Prefect artifacts."""
    fault_point("report", iteration)
    tracker.log_metrics(iteration, summary["metrics"])
    preview(recipe, tracker, storage, iteration)
    artifacts.iteration(summary)


def catch_up(recipe: Recipe, tracker: Tracker, storage: Any, run_name: str, first: int) -> list[int]:
    """The bookkeeping of committed iterations before `first` that a killed run had not finished
    (their MLflow step is missing; an iteration's jobs run in order, its metrics last): its
    registry entry, held-out results and report, from what storage holds. Returns them."""
    missing = [i for i in range(first) if not tracker.has_step(i)]
    for i in missing:
        version = i + 1
        if storage.exists(join(storage.weights_rel(version), MANIFEST)):
            register(recipe, tracker, storage, run_name, version)
        evaluated = join(eval_dir(version), "metrics.json")
        if storage.exists(evaluated):
            report_eval(recipe, tracker, run_name, version, storage.read_json(evaluated)["metrics"])
        tracker.log_metrics(i, storage.read_json(join(iter_dir(i), "_SUCCESS"))["metrics"])
        preview(recipe, tracker, storage, i)
    return missing


def preview(recipe: Recipe, tracker: Tracker, storage: Any, iteration: int) -> None:
    """What people should see of the iteration's rollouts in MLflow every `tracking.preview_every`
    iterations (the policy decides: a samples table for text, an image grid for flow models);
    never fails the run."""
    every = recipe.tracking.preview_every
    if not every or iteration % every:
        return
    try:
        policy_for(recipe).log_preview(recipe, tracker, storage, iteration)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("rollout preview of %s not logged: %s", iter_dir(iteration), exc)


def register(recipe: Recipe, tracker: Tracker, storage: Any, run_name: str, version: int) -> None:
    """Published weights `version` as a version of the MLflow registered model named after the
    recipe (`tracking.registry`), its source the weights folder in run storage."""
    if not recipe.tracking.registry:
        return
    rel = storage.weights_rel(version)
    tracker.register_version(recipe.name, run_name, version, storage.url(rel), storage.read_json(join(rel, MANIFEST)))


def held_out(recipe: Recipe, run_name: str, version: int, tracker: Tracker, label: str, books: Bookkeeping) -> dict[str, float]:
    """Evaluate policy `version` on the held-out split and print it; MLflow, the registry entry's
    tags and the table artifact get the metrics on the bookkeeping thread."""
    if not storage_of(recipe, run_name).exists(join(eval_dir(version), "metrics.json")):  # minutes on a big split
        say(f"[unirl] evaluating v{version:06d} on the held-out prompts (greedy, and {recipe.eval.k} samples each) ...")
    result = staged(evaluate)(recipe, run_name, version)
    m = result["metrics"]
    say(f"[unirl] held-out v{version:06d}{' (' + label + ')' if label else ''}: {summary(recipe, m)}")
    books.submit(report_eval, recipe, tracker, run_name, version, m)
    return m


def report_eval(recipe: Recipe, tracker: Tracker, run_name: str, version: int, m: dict[str, float]) -> None:
    tracker.log_metrics(version, m, key="eval/accuracy")  # once, also when a killed run had computed it
    if recipe.tracking.registry:
        tracker.tag_version(recipe.name, run_name, version, m)
    eval_artifact(recipe, run_name, version, m)

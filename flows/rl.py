"""The RL training run as Prefect flows: one `rl-train` flow run for the whole run, and one
iteration flow run per iteration (named iter-000007) whose tasks are its stages.

One run loop (`train_run`) drives every shape a recipe can have (flows/shapes/: a single
model, a pipeline of models, a unified model): the warm start, the resume after the last
finished iteration, held-out and test evaluation, the weights versions in the registry, MLflow,
previews and Prefect artifacts, off the critical path where they can be. A run resumes after its
last finished iteration; every stage returns its committed output instead of recomputing it.
"""
from __future__ import annotations

import os
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.settings import temporary_settings
from pydantic import Field

from unirl.flows.ahead import Ahead
from unirl.flows.artifacts import RunArtifacts
from unirl.flows.bookkeeping import Bookkeeping
from unirl.flows.evaluate import eval_artifact, eval_preview, report_test, summary, test_split
from unirl.flows.hooks import stop_worker_group
from unirl.flows.shapes import Models, RunShape, rl_iteration, shape_of
from unirl.stages.recipe import MAX_OVERRIDES, Recipe, with_overrides
from unirl.stages.run.evaluation import eval_dir
from unirl.stages.run.record import open_run, update_run_info
from unirl.stages.run.tracking import Tracker, model_card
from unirl.stages.runtime.accumulation import closes, iterations_error, version_after
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.lease import RunLease
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.storage import iter_dir, join
from unirl.stages.train.manifests import MANIFEST
from unirl.stages.workers.group import close_group
from unirl.tasks.common import close_engine, run_tags, staged, start_producer, stop_producer, storage_of
from unirl.tasks.console import Progress, log_to_run_folder, say

__all__ = ["rl_iteration", "rl_train", "train_run"]


def starts_ahead() -> bool:
    """Whether each iteration's flow run starts while the previous one works (flows/ahead.py), by
    UNIRL_OVERLAP_ITERATIONS: "on" (the default) or "off"."""
    mode = os.environ.get("UNIRL_OVERLAP_ITERATIONS", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"UNIRL_OVERLAP_ITERATIONS={mode!r}: use on or off")
    return mode == "on"


@flow(name="rl-train", flow_run_name="{recipe.name}/{run_name}",
      on_cancellation=[stop_worker_group], on_crashed=[stop_worker_group])
def rl_train(
    recipe: Recipe, run_name: str = "", iterations: Annotated[int | None, Field(ge=1)] = None,
    overrides: Annotated[list[str] | None, Field(max_length=MAX_OVERRIDES)] = None,
) -> dict[str, Any]:
    """Run (or resume) `recipe` as run `run_name` (default: the recipe's name).

    Args:
        recipe: The whole run: model, data, rollout, reward, algorithm, training, storage.
        run_name: Run folder name (default: the recipe's name); the same name resumes the run.
        iterations: Overrides `recipe.iterations` (e.g. `--param iterations=2`); more than the
            run has finished extends it.
        overrides: `key.sub=value` changes to the recipe, applied as `unirl run` applies them
            (e.g. `train.lr=3e-4`, `reward.scorers=[{name: exact_match}]`), so one field changes
            without rewriting the recipe.
    """
    recipe = with_overrides(recipe, overrides or [])  # a bad override fails here, naming it
    run_name = run_name or recipe.name
    if iterations is not None:
        recipe = recipe.model_copy(update={"iterations": iterations})
        if (error := iterations_error(recipe, iterations)) is not None:
            raise ValueError(error)
    build_prompt_source(recipe.data)  # a bad data file fails here, before any model loads
    lease = RunLease(storage_of(recipe, run_name), log=lambda m: say(f"[unirl] {m}")).acquire()  # one owner per run
    try:
        return train_run(recipe, run_name)
    finally:
        lease.release()


def train_run(recipe: Recipe, run_name: str) -> dict[str, Any]:
    """The body of `rl_train`, under the run's lease: the one run loop, for every shape."""
    logger = get_run_logger()
    shape = shape_of(recipe)
    storage, info = open_run(recipe, run_name)
    models: Models = {}
    progress: Progress | None = None
    books = Bookkeeping()  # MLflow, previews, the registry, progress: off the critical path
    ahead = Ahead(run_name, recipe.iterations, lambda i: shape.iteration(recipe, run_name, i))
    tracker: Tracker | None = None
    artifacts: RunArtifacts | None = None
    try:
        models = shape.models(recipe, run_name, storage)
        shape.prepare(recipe, storage)
        tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
        if info.get("mlflow_run_id") != tracker.run_id:
            info = update_run_info(storage, mlflow_run_id=tracker.run_id)
        shape.warm_start(recipe, run_name, storage, tracker)
        register(recipe, tracker, run_name, models, 0)
        first = storage.last_success() + 1
        if first > 0:
            logger.info("resuming %s at %s", storage.url(), iter_dir(first))
        log_file = log_to_run_folder(storage.local_path())
        say(f"[unirl] run {run_name} at {storage.url()}  (MLflow {tracker.link()})"
            + (f"\n[unirl] log: {log_file}" if log_file else ""))
        artifacts = RunArtifacts(recipe, run_name, storage, tracker)
        artifacts.start(first)
        caught = catch_up(shape, recipe, tracker, storage, run_name, models, first)
        if caught:
            # Not worded as an iteration's line ("[unirl] iter-..."): the killed run may have printed those already.
            say(f"[unirl] the killed run committed {', '.join(iter_dir(i) for i in caught)} but had not logged it to MLflow: logged now")
        progress = Progress(recipe.iterations, first)
        evals: dict[int, dict[str, float]] = {}
        last: dict[str, Any] = {}
        overlap = starts_ahead()
        # The run's own flow run keeps its heartbeat (started with it); one per iteration flow run
        # would cost up to a second each (Prefect joins a heartbeat thread that sleeps in 1 s
        # steps). Entered once per run.
        with run_tags(recipe, run_name), temporary_settings(updates={"flows.heartbeat_frequency": None}):
            if recipe.rollout.mode == "async" and first < recipe.iterations:
                start_producer(recipe, run_name, storage)  # samples ahead while the trainer trains
            tested = None
            if recipe.eval.enabled:
                evals[0] = held_out(shape, recipe, run_name, 0, tracker, models, "before RL", books)
                tested = test_split(recipe, run_name, 0, shape.evaluate, compute=first == 0)  # reported after RL
            for i in range(first, recipe.iterations):
                summary_ = ahead.take(i) if overlap else shape.iteration(recipe, run_name, i)
                progress.iteration(i, summary_["metrics"])  # before its evaluation: the console reads top to bottom
                if closes(recipe, i):  # a new policy version (rollout accumulation: at a window's end only)
                    version, last_ = version_after(recipe, i), i == recipe.iterations - 1
                    books.submit(register, recipe, tracker, run_name, models, version)
                    if (recipe.eval.every and version % recipe.eval.every == 0) or (recipe.eval.enabled and last_):
                        label = "after RL" if last_ else ""
                        evals[version] = held_out(shape, recipe, run_name, version, tracker, models, label, books)
                        if label:
                            report_test(recipe, run_name, tracker, tested, version, shape.evaluate, books)
                storage.mark_success(i, summary_)
                books.submit(report, shape, recipe, tracker, storage, artifacts, i, summary_)
                last = summary_
        ahead.close()  # the last flow run's end
        books.close()
    except BaseException:
        for end in (ahead.close, books.close):
            try:
                end()
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
                logger.warning("ending the run after the failure also failed: %s: %s", type(exc).__name__, exc)
        if tracker is not None:
            tracker.finish("FAILED")
        if artifacts is not None:
            artifacts.publish_table()
        raise
    finally:
        if progress is not None:
            progress.close()
        for store in {storage.url(), *(store.url() for store, _, _ in models.values())}:
            stop_producer(store)
            close_engine(store)
            close_group(store)
    tracker.finish()
    artifacts.finish()
    return {"run": run_name, "storage": storage.url(), "iterations": recipe.iterations,
            "last": last, "mlflow_run_id": tracker.run_id, "eval": {str(k): v for k, v in evals.items()}}


def report(shape: RunShape, recipe: Recipe, tracker: Tracker, storage: Any, artifacts: RunArtifacts, iteration: int,
           summary_: dict[str, Any]) -> None:
    """What a committed iteration reports (on the bookkeeping thread): its metrics to MLflow, its
    rollout preview, its row in the Prefect artifacts."""
    fault_point("report", iteration)
    tracker.log_metrics(iteration, summary_["metrics"])
    preview(shape, recipe, tracker, storage, iteration)
    artifacts.iteration(summary_)


def catch_up(shape: RunShape, recipe: Recipe, tracker: Tracker, storage: Any, run_name: str, models: Models,
             first: int) -> list[int]:
    """The bookkeeping of committed iterations before `first` that a killed run had not finished
    (their MLflow step is missing; an iteration's jobs run in order, its metrics last): its
    registry entries, held-out results and report, from what storage holds. Returns them."""
    missing = [i for i in range(first) if not tracker.has_step(i)]
    for i in missing:
        if closes(recipe, i):
            version = version_after(recipe, i)
            register(recipe, tracker, run_name, models, version)
            evaluated = join(eval_dir(version), "metrics.json")
            if storage.exists(evaluated):
                report_eval(shape, recipe, tracker, run_name, models, version, storage.read_json(evaluated)["metrics"])
        tracker.log_metrics(i, storage.read_json(join(iter_dir(i), "_SUCCESS"))["metrics"])
        preview(shape, recipe, tracker, storage, i)
    return missing


def preview(shape: RunShape, recipe: Recipe, tracker: Tracker, storage: Any, iteration: int) -> None:
    """What people should see of the iteration's rollouts in MLflow every `tracking.preview_every`
    iterations (the shape decides: a samples table for text, an image grid for flow models, both
    for composed runs); never fails the run."""
    every = recipe.tracking.preview_every
    if not every or iteration % every:
        return
    try:
        shape.preview(recipe, tracker, storage, iteration)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("rollout preview of %s not logged: %s", iter_dir(iteration), exc)


def register(recipe: Recipe, tracker: Tracker, run_name: str, models: Models, version: int) -> None:
    """Each model's published weights `version` as a version of its registered model in MLflow
    (`tracking.registry`), its source the weights folder in run storage; a model publishes every
    `checkpoint_every` versions, and a frozen one only v000000."""
    if not recipe.tracking.registry:
        return
    for name, (store, trains, model) in models.items():
        rel = store.weights_rel(version)
        if (version == 0 or trains) and store.exists(join(rel, MANIFEST)):
            if not store.exists(join(rel, "MLmodel")):  # what the registry page shows it takes and gives
                for file, data in model_card(families.get(model.kind), example_prompt(recipe)).items():
                    store.write_bytes(join(rel, file), data)
            tracker.register_version(name, run_name, version, store.url(rel), store.read_json(join(rel, MANIFEST)))


_EXAMPLES: dict[str, str] = {}  # a prompt source's JSON -> its first training prompt


def example_prompt(recipe: Recipe) -> str:
    """The first training prompt: a registered version's input example (each source built once)."""
    key = recipe.data.model_dump_json()
    if key not in _EXAMPLES:
        _EXAMPLES[key] = str(build_prompt_source(recipe.data).batch(0, 1)[0].text)
    return _EXAMPLES[key]


def held_out(shape: RunShape, recipe: Recipe, run_name: str, version: int, tracker: Tracker, models: Models, label: str,
             books: Bookkeeping) -> dict[str, float]:
    """Evaluate `version` on the dev split and print it; MLflow, the registry entries' tags, the
    table artifact and the preview get the metrics on the bookkeeping thread."""
    if not storage_of(recipe, run_name).exists(join(eval_dir(version), "metrics.json")):  # minutes on a big split
        say(f"[unirl] evaluating v{version:06d} on the held-out prompts (greedy, and {recipe.eval.k} samples each) ...")
    m = staged(shape.evaluate)(recipe, run_name, version)["metrics"]
    say(f"[unirl] held-out v{version:06d}{' (' + label + ')' if label else ''}: {summary(recipe, m)}")
    books.submit(report_eval, shape, recipe, tracker, run_name, models, version, m)
    return m


def report_eval(shape: RunShape, recipe: Recipe, tracker: Tracker, run_name: str, models: Models, version: int,
                m: dict[str, float]) -> None:
    tracker.log_metrics(version, m, key="eval/accuracy")  # once, also when a killed run had computed it
    if recipe.tracking.registry:
        for name in models:
            tracker.tag_version(name, run_name, version, m)
    eval_artifact(recipe, run_name, version, m)
    eval_preview(recipe, run_name, version, tracker)

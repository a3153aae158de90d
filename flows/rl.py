"""The RL training run as Prefect flows: one `rl-train` flow run for the whole run, and one
iteration flow run per iteration (named <run>/iter-000007) whose tasks are its stages.

One run loop (`train_run`) drives every shape a recipe can have (flows/shapes/: a single
model, a pipeline of models, a unified model; each iteration the one sequence of
stages/run/sequence.py): the warm start, the resume after the last finished iteration, held-out
and test evaluation, and the run's events (stages/run/events.py), which the console, MLflow, the
model registry, previews and Prefect artifacts read (flows/readers.py), off the critical path
where they can be. A run resumes after its last finished iteration; every stage returns its
committed output instead of recomputing it.
"""
from __future__ import annotations

import getpass
import os
import subprocess
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.settings import temporary_settings
from pydantic import Field

from unirl.flows.ahead import Ahead
from unirl.flows.artifacts import RunArtifacts
from unirl.flows.evaluate import evaluated
from unirl.flows.hooks import stop_worker_group
from unirl.flows.readers import Artifacts, Console, Mlflow, Previews, Registry
from unirl.flows.shapes import Models, RunShape, rl_iteration, shape_of
from unirl.stages.recipe import MAX_OVERRIDES, Recipe, with_overrides
from unirl.stages.run.evaluation import eval_dir, has_split
from unirl.stages.run.events import (
    EvaluationDone,
    IterationCommitted,
    IterationEnded,
    RunEvents,
    RunFinished,
    RunStarted,
    VersionPublished,
)
from unirl.stages.run.record import finished_error, mark_finished, open_run, update_run_info
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.accumulation import closes, iterations_error, version_after
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.lease import RunLease
from unirl.stages.runtime.storage import check_run_name, iter_dir, join
from unirl.stages.workers.group import close_group
from unirl.tasks.common import close_engine, run_tags, start_producer, stop_producer, storage_of
from unirl.tasks.console import log_to_run_folder, say

__all__ = ["rl_iteration", "rl_train", "train_run"]


def starts_ahead() -> bool:
    """Whether each iteration's flow run starts while the previous one works (flows/ahead.py), by
    UNIRL_OVERLAP_ITERATIONS: "on" (the default) or "off"."""
    mode = os.environ.get("UNIRL_OVERLAP_ITERATIONS", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"UNIRL_OVERLAP_ITERATIONS={mode!r}: use on or off")
    return mode == "on"


def chosen_run_name(recipe_name: str, run_name: str) -> str:
    """The run folder of an `rl-train` flow run: `run_name` when given; else, for a flow run of a
    deployment, its Prefect name (the Run form's "Run Name", or the name Prefect generated), so a
    deployment run never lands in a finished run's folder by default; else the recipe's name.
    The same before and after Prefect renames the flow run to `<recipe>/<run name>`."""
    if run_name:
        return run_name
    if deployment.id and flow_run.name:
        return check_run_name(flow_run.name.removeprefix(f"{recipe_name}/"),
                              "the flow run's name (its Run Name; or set the run_name parameter)")
    return recipe_name


def flow_run_label() -> str:
    """`<recipe>/<run name>`: how the Prefect UI lists an `rl-train` flow run."""
    params = flow_run.parameters
    recipe = params.get("recipe")
    name = recipe.name if isinstance(recipe, Recipe) else str((recipe or {}).get("name", "run"))
    return f"{name}/{chosen_run_name(name, params.get('run_name') or '')}"


@flow(name="rl-train", flow_run_name=flow_run_label,
      on_cancellation=[stop_worker_group], on_crashed=[stop_worker_group])
def rl_train(
    recipe: Recipe, run_name: str = "", iterations: Annotated[int | None, Field(ge=1)] = None,
    overrides: Annotated[list[str] | None, Field(max_length=MAX_OVERRIDES)] = None, resume: bool = False,
) -> dict[str, Any]:
    """Run (or resume) `recipe` as run `run_name`.

    Args:
        recipe: The whole run: model, data, rollout, reward, algorithm, training, storage.
        run_name: Run folder name; the same name resumes an unfinished run. Empty: the flow run's
            name (the Run Name above) for a deployment's run, else the recipe's name.
        iterations: Overrides `recipe.iterations` (e.g. `--param iterations=2`); more than the
            run has finished extends it.
        overrides: `key.sub=value` changes to the recipe, applied as `unirl run` applies them
            (e.g. `train.lr=3e-4`, `reward.scorers=[{name: exact_match}]`), so one field changes
            without rewriting the recipe.
        resume: Start a finished run again to report it (its held-out lines, anything MLflow
            misses) instead of failing with "run X is finished".
    """
    run_name = chosen_run_name(recipe.name, run_name)
    recipe = with_overrides(recipe, overrides or [])  # a bad override fails here, naming it
    if iterations is not None:
        recipe = recipe.model_copy(update={"iterations": iterations})
        if (error := iterations_error(recipe, iterations)) is not None:
            raise ValueError(error)
    build_prompt_source(recipe.data)  # a bad data file fails here, before any model loads
    if not resume and (finished := finished_error(recipe, run_name)) is not None:
        raise finished
    lease = RunLease(storage_of(recipe, run_name), log=lambda m: say(f"[unirl] {m}")).acquire()  # one owner per run
    try:
        return train_run(recipe, run_name)
    finally:
        lease.release()


def train_run(recipe: Recipe, run_name: str) -> dict[str, Any]:
    """The body of `rl_train`, under the run's lease: the one run loop, for every shape. It says
    what happened (stages/run/events.py); the console, MLflow, the registry, previews and the
    Prefect artifacts are its readers (flows/readers.py)."""
    logger = get_run_logger()
    shape = shape_of(recipe)
    storage, info = open_run(recipe, run_name)
    models: Models = {}
    events = RunEvents(logger)
    ahead = Ahead(run_name, recipe.iterations, lambda i: shape.iteration(recipe, run_name, i))
    try:
        models = shape.models(recipe, run_name, storage)
        shape.prepare(recipe, storage)
        tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"), links())
        if info.get("mlflow_run_id") != tracker.run_id:
            info = update_run_info(storage, mlflow_run_id=tracker.run_id, mlflow_url=tracker.link())
        shape.warm_start(recipe, run_name, storage, tracker)
        events.subscribe(Console(recipe))
        for reader in (Mlflow(tracker), Registry(recipe, tracker, run_name, models), Previews(shape, recipe, tracker, storage),
                       Artifacts(recipe, run_name, RunArtifacts(recipe, run_name, storage, tracker))):
            events.subscribe(reader, background=True)  # off the critical path
        events.emit(VersionPublished(0))
        first = storage.last_success() + 1
        if first > 0:
            logger.info("resuming %s at %s", storage.url(), iter_dir(first))
        log_file = log_to_run_folder(storage.local_path())
        say(f"[unirl] run {run_name} at {storage.url()}  (MLflow {tracker.link()})"
            + (f"\n[unirl] log: {log_file}" if log_file else ""))
        events.emit(RunStarted(first))
        caught = catch_up(recipe, tracker, storage, events, first)
        if caught:
            # Not worded as an iteration's line ("[unirl] iter-..."): the killed run may have printed those already.
            say(f"[unirl] the killed run committed {', '.join(iter_dir(i) for i in caught)} but had not logged it to MLflow: logged now")
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
                evals[0] = held_out(events, shape, recipe, run_name, 0, "before RL")
                tested = test_split(events, shape, recipe, run_name, 0, compute=first == 0)  # reported after RL
            for i in range(first, recipe.iterations):
                summary = ahead.take(i) if overlap else shape.iteration(recipe, run_name, i)
                events.emit(IterationEnded(i, summary))
                if closes(recipe, i):  # a new policy version (rollout accumulation: at a window's end only)
                    version, last_ = version_after(recipe, i), i == recipe.iterations - 1
                    events.emit(VersionPublished(version))
                    if (recipe.eval.every and version % recipe.eval.every == 0) or (recipe.eval.enabled and last_):
                        evals[version] = held_out(events, shape, recipe, run_name, version, "after RL" if last_ else "")
                        after = test_split(events, shape, recipe, run_name, version) if last_ else None
                        if after is not None:
                            events.emit(EvaluationDone(version, after, "test", "after RL", before=tested))
                storage.mark_success(i, summary)
                events.emit(IterationCommitted(i, summary))
                last = summary
        ahead.close()  # the last flow run's end
        result = {"run": run_name, "storage": storage.url(), "iterations": recipe.iterations, "last": last,
                  "mlflow_run_id": tracker.run_id, "eval": {str(k): v for k, v in evals.items()}}
        events.close(RunFinished(ok=True, result=result))  # a reader's failure fails the run
        mark_finished(storage, recipe.iterations)  # starting it again now says so (rl_train)
    except BaseException:
        try:
            ahead.close()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
            logger.warning("ending the run after the failure also failed: %s: %s", type(exc).__name__, exc)
        events.close(RunFinished(ok=False))
        raise
    finally:
        for store in {storage.url(), *(store.url() for store, _, _ in models.values())}:
            stop_producer(store)
            close_engine(store)
            close_group(store)
    return result


def links() -> dict[str, str]:
    """What the MLflow run says of where it comes from: the Prefect flow run (id, and its page
    when a server's UI shows it), the deployment, the git commit of this code and whether the
    checkout had changes, and who ran it (MLflow's own tags for a run's source and user)."""
    out = {"mlflow.source.name": "unirl rl-train", "mlflow.source.type": "JOB", "mlflow.user": getpass.getuser()}
    if flow_run.id:
        out["prefect.flow_run_id"] = str(flow_run.id)
    if flow_run.ui_url:
        out["prefect.flow_run_url"] = str(flow_run.ui_url)
    if deployment.name:
        out["prefect.deployment"] = str(deployment.name)
    code = Path(__file__).resolve().parents[1]  # the checkout this code runs from (none for an installed wheel)
    try:
        commit = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        changed = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return out
    if commit.returncode == 0:
        out["mlflow.source.git.commit"] = commit.stdout.strip()
        out["unirl.git_dirty"] = str(bool(changed.stdout.strip())).lower()
    return out


def catch_up(recipe: Recipe, tracker: Tracker, storage: Any, events: RunEvents, first: int) -> list[int]:
    """What a killed run committed before `first` but had not reported (its MLflow step is
    missing; an iteration's reports go in order, its metrics last), replayed from what storage
    holds: its version, its held-out results, its metrics. Returns those iterations."""
    missing = [i for i in range(first) if not tracker.has_step(i)]
    for i in missing:
        if closes(recipe, i):
            version = version_after(recipe, i)
            events.emit(VersionPublished(version, replayed=True))
            evaluated = join(eval_dir(version), "metrics.json")
            if storage.exists(evaluated):
                events.emit(EvaluationDone(version, storage.read_json(evaluated)["metrics"], replayed=True))
        events.emit(IterationCommitted(i, storage.read_json(join(iter_dir(i), "_SUCCESS")), replayed=True))
    return missing


def held_out(events: RunEvents, shape: RunShape, recipe: Recipe, run_name: str, version: int, label: str) -> dict[str, float]:
    """`version` on the dev split."""
    m = evaluated(events, recipe, run_name, version, shape.evaluate)
    assert m is not None, "computed when not stored"
    events.emit(EvaluationDone(version, m, "dev", label))
    return m


def test_split(events: RunEvents, shape: RunShape, recipe: Recipe, run_name: str, version: int, *,
               compute: bool = True) -> dict[str, float] | None:
    """`version` on the test split (`eval.test`), kept in storage and reported after RL, not
    before: runs are watched and tuned on the dev split. None where the data has no test split,
    or where it is not stored yet and `compute` is off (a resumed run's group no longer holds the
    weights before RL)."""
    if not (recipe.eval.enabled and recipe.eval.test and has_split(recipe, "test")):
        return None
    return evaluated(events, recipe, run_name, version, shape.evaluate, "test", compute=compute, note="reported after RL")

"""Held-out evaluation of a run's policy as a Prefect flow (also run inside training every
`eval.every` iterations and before/after RL): greedy accuracy, avg@k and pass@k, logged to
MLflow and published as a Prefect table artifact."""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from unirl.flows.artifacts import artifact_key
from unirl.flows.bookkeeping import Bookkeeping
from unirl.flows.forms import InnerRecipe
from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import PREFIX, eval_dir, has_split
from unirl.stages.run.record import open_run
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.storage import join
from unirl.stages.workers.group import close_group
from unirl.tasks.common import close_engine, staged, storage_of
from unirl.tasks.console import say


def eval_artifact(recipe: Recipe, run_name: str, version: int, metrics: dict[str, float]) -> None:
    """Publish an evaluation as a Prefect table artifact."""
    create_table_artifact(
        key=artifact_key(f"{recipe.name}-{run_name}", "eval"),
        table=[{"version": version, **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()}}],
        description=f"held-out evaluation of {run_name} at policy version {version}",
    )


def eval_preview(recipe: Recipe, run_name: str, version: int, tracker: Tracker | None = None) -> None:
    """The held-out preview of `version` in the run's MLflow run, as its shape shows it (flow
    models: a grid, an animated one for video; composed runs: each image with its text);
    `tracking.preview_every` 0: none. Never fails the run."""
    from prefect import get_run_logger

    from unirl.flows.shapes import shape_of

    if not recipe.tracking.preview_every:
        return
    try:
        storage = storage_of(recipe, run_name)
        if tracker is None:
            run_id = storage.read_json("run.json").get("mlflow_run_id")
            if run_id is None:
                return
            tracker = Tracker(recipe, storage, run_name, run_id)
        shape_of(recipe).eval_preview(recipe, tracker, storage, version)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("held-out preview of v%06d not logged: %s", version, exc)


def summary(recipe: Recipe, m: dict[str, float], split: str = "dev") -> str:
    """`accuracy 0.250  avg@4 0.312  pass@4 0.500  (16 prompts)` of an evaluation's metrics."""
    k, p = recipe.eval.k, PREFIX[split]
    agent = (f"  turns {m[f'{p}/turns_mean']:.2f}  tool ok {m[f'{p}/tool_success']:.2f}"
             if f"{p}/turns_mean" in m else "")  # an agent's sampled trajectories
    domains = [key.split("/")[1] for key in m if key.startswith(f"{p}/") and key.endswith("/accuracy") and key.count("/") == 2]
    scores = [f"{d} {m[p + '/' + d + '/accuracy']:.3f}" for d in domains]  # a mixture's, per domain
    per_domain = f"  [{', '.join(scores)}]" if scores else ""
    return (f"accuracy {m[f'{p}/accuracy']:.3f}  avg@{k} {m[f'{p}/avg_at_{k}']:.3f}  pass@{k} {m[f'{p}/pass_at_{k}']:.3f}"
            f"{agent}  ({int(m[f'{p}/prompts'])} prompts){per_domain}")


def test_split(recipe: Recipe, run_name: str, version: int, task: Any, *, compute: bool = True) -> dict[str, float] | None:
    """Policy `version` on the test split (`eval.test`), kept in storage and printed by `report_test`
    after RL, not now: runs are watched and tuned on the dev split. None where the data has no
    test split, or where it is not stored yet and `compute` is off (a resumed run's group no
    longer holds the weights before RL)."""
    if not (recipe.eval.enabled and recipe.eval.test) or not has_split(recipe, "test"):
        return None
    if not storage_of(recipe, run_name).exists(join(eval_dir(version, "test"), "metrics.json")):
        if not compute:
            return None
        say(f"[unirl] evaluating v{version:06d} on the test prompts (reported after RL) ...")
    return staged(task)(recipe, run_name, version, "test")["metrics"]


def report_test(recipe: Recipe, run_name: str, tracker: Tracker, before: dict[str, float] | None, version: int,
                task: Any, books: Bookkeeping) -> None:
    """The test split after RL, beside its value before RL: printed once, logged to MLflow as `test/*`
    (and on the registry version it evaluates). The MLflow writes queue on `books` (bookkeeping.py,
    one thread in order), after the registration of `version` queued before them."""
    after = test_split(recipe, run_name, version, task)
    if after is None:
        return
    books.submit(log_test, recipe, run_name, tracker, before, version, after)
    was = f"  (v000000 before RL: {summary(recipe, before, 'test')})" if before is not None else ""
    say(f"[unirl] test v{version:06d} (after RL): {summary(recipe, after, 'test')}{was}")


def log_test(recipe: Recipe, run_name: str, tracker: Tracker, before: dict[str, float] | None, version: int,
             after: dict[str, float]) -> None:
    if before is not None:
        tracker.log_metrics(0, before, key="test/accuracy")
    tracker.log_metrics(version, after, key="test/accuracy")
    if recipe.tracking.registry:
        tracker.tag_version(recipe.name, run_name, version, after)


@flow(name="evaluate", flow_run_name="{recipe.name}/{run_name}/eval")
def evaluate_run(recipe: InnerRecipe, run_name: str = "", version: int | None = None, split: str = "dev") -> dict[str, Any]:
    """Evaluate policy `version` of run `run_name` (default: its last finished iteration) on the
    `dev` or `test` split."""
    from unirl.flows.shapes import shape_of

    run_name = run_name or recipe.name
    storage, info = open_run(recipe, run_name)
    if version is None:
        version = storage.last_success() + 1
    if not storage.exists(join(eval_dir(version, split), "metrics.json")):
        say(f"[unirl] evaluating v{version:06d} of {run_name} on the {split} prompts (greedy, and {recipe.eval.k} samples each) ...")
    shape = shape_of(recipe)
    try:
        result = staged(shape.evaluate)(recipe, run_name, version, split)
    finally:
        for store in {storage.url(), *(store.url() for store, _, _ in shape.models(recipe, run_name, storage).values())}:
            close_engine(store)
            close_group(store)
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    tracker.log_metrics(version, result["metrics"], key=f"{PREFIX[split]}/accuracy")
    if recipe.tracking.registry:  # the results land on the version they evaluate
        for name in shape.models(recipe, run_name, storage):
            tracker.tag_version(name, run_name, version, result["metrics"])
    if split == "dev":
        eval_artifact(recipe, run_name, version, result["metrics"])
        eval_preview(recipe, run_name, version, tracker)
    say(f"[unirl] {'held-out' if split == 'dev' else split} v{version:06d}: {summary(recipe, result['metrics'], split)}")
    return result

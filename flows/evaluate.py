"""Held-out evaluation of a run's policy as a Prefect flow (also run inside training every
`eval.every` iterations and before/after RL): greedy accuracy, avg@k and pass@k, logged to
MLflow and published as a Prefect table artifact by the run's readers (flows/readers.py)."""
from __future__ import annotations

from typing import Any

from prefect import flow

from unirl.flows.forms import InnerRecipe
from unirl.flows.readers import Artifacts, Console, Mlflow, Previews, Registry
from unirl.flows.shapes import shape_of
from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import eval_dir
from unirl.stages.run.events import EvaluationDone, EvaluationStarted, RunEvents
from unirl.stages.run.record import open_run
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.storage import join
from unirl.stages.workers.group import close_group
from unirl.tasks.common import close_engine, staged, storage_of


def evaluated(events: RunEvents, recipe: Recipe, run_name: str, version: int, task: Any, split: str = "dev", *,
              compute: bool = True, note: str = "") -> dict[str, float] | None:
    """Policy `version`'s metrics on `split` by the shape's evaluate `task`: stored ones as they
    are, else computed (`EvaluationStarted` first: minutes on a big split). None where they are
    not stored and `compute` is off."""
    if not storage_of(recipe, run_name).exists(join(eval_dir(version, split), "metrics.json")):
        if not compute:
            return None
        events.emit(EvaluationStarted(version, split, note))
    return staged(task)(recipe, run_name, version, split)["metrics"]


@flow(name="evaluate", flow_run_name="{recipe.name}/{run_name}/eval")
def evaluate_run(recipe: InnerRecipe, run_name: str = "", version: int | None = None, split: str = "dev") -> dict[str, Any]:
    """Evaluate policy `version` of run `run_name` (default: its last finished iteration) on the
    `dev` or `test` split."""
    run_name = run_name or recipe.name
    storage, info = open_run(recipe, run_name)
    if version is None:
        version = storage.last_success() + 1
    shape = shape_of(recipe)
    models = shape.models(recipe, run_name, storage)
    events = RunEvents()
    events.subscribe(Console(recipe, run_name))
    try:
        metrics = evaluated(events, recipe, run_name, version, shape.evaluate, split)
    finally:
        for store in {storage.url(), *(store.url() for store, _, _ in models.values())}:
            close_engine(store)
            close_group(store)
    assert metrics is not None, "computed when not stored"
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    for reader in (Mlflow(tracker, finishes=False), Registry(recipe, tracker, run_name, models),
                   Previews(shape, recipe, tracker, storage), Artifacts(recipe, run_name)):
        events.subscribe(reader)  # the results land on the version they evaluate, here before the flow ends
    events.emit(EvaluationDone(version, metrics, split))
    events.close(None)
    return {"version": version, "metrics": metrics}

"""Held-out evaluation of a run's policy as a Prefect flow (also run inside training every
`eval.every` iterations and before/after RL): greedy accuracy, avg@k and pass@k, logged to
MLflow and published as a Prefect table artifact."""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.console import say

from stages.recipe import Recipe
from stages.run import open_run
from stages.tracking import Tracker
from stages.workers.group import close_group
from tasks.common import close_engine
from tasks.common import staged
from tasks.evaluate import evaluate


def eval_artifact(recipe: Recipe, run_name: str, version: int, metrics: dict[str, float]) -> None:
    key = f"{recipe.name}-{run_name}-eval".lower().replace("_", "-").replace("/", "-")
    create_table_artifact(
        key=key, table=[{"version": version, **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()}}],
        description=f"held-out evaluation of {run_name} at policy version {version}",
    )


@flow(name="evaluate", flow_run_name="{recipe.name}/{run_name}/eval")
def evaluate_run(recipe: Recipe, run_name: str = "", version: int | None = None) -> dict[str, Any]:
    """Evaluate policy `version` of run `run_name` (default: its last finished iteration)."""
    run_name = run_name or recipe.name
    storage, info = open_run(recipe, run_name)
    if version is None:
        version = storage.last_success() + 1
    try:
        result = staged(evaluate)(recipe, run_name, version)
    finally:
        close_engine(storage.url())
        close_group(storage.url())
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    tracker.log_metrics(version, result["metrics"], key="eval/accuracy")
    if recipe.tracking.registry:  # the results land on the version they evaluate
        tracker.tag_version(recipe.name, run_name, version, result["metrics"])
    eval_artifact(recipe, run_name, version, result["metrics"])
    say(f"[unirl] held-out v{version:06d}: " + "  ".join(f"{k} {v:.3f}" for k, v in result["metrics"].items()))
    return result

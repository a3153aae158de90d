"""Held-out evaluation of a run's policy as a Prefect flow (also run inside training every
`eval.every` iterations and before/after RL): greedy accuracy, avg@k and pass@k, logged to
MLflow and published as a Prefect table artifact."""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.console import say

from stages.evaluation import eval_dir
from stages.recipe import Recipe
from stages.run import open_run
from stages.storage import join
from stages.tracking import Tracker
from stages.workers.group import close_group
from tasks.common import close_engine
from tasks.common import staged
from tasks.evaluate import evaluate


def eval_artifact(recipe: Recipe, run_name: str, version: int, metrics: dict[str, float]) -> None:
    """Publish an evaluation: a Prefect table artifact, and the policy's preview of the held-out
    samples in MLflow (flow models: a grid, an animated one for video)."""
    key = f"{recipe.name}-{run_name}-eval".lower().replace("_", "-").replace("/", "-")
    create_table_artifact(
        key=key, table=[{"version": version, **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()}}],
        description=f"held-out evaluation of {run_name} at policy version {version}",
    )
    eval_preview(recipe, run_name, version)


def eval_preview(recipe: Recipe, run_name: str, version: int) -> None:
    """The held-out preview of policy `version` in the run's MLflow run (`tracking.preview_every`
    0: none); never fails the run."""
    from prefect import get_run_logger

    from stages.policies import policy_for
    from tasks.common import storage_of

    if not recipe.tracking.preview_every:
        return
    try:
        storage = storage_of(recipe, run_name)
        run_id = storage.read_json("run.json").get("mlflow_run_id")
        if run_id is not None:
            policy_for(recipe).log_eval_preview(recipe, Tracker(recipe, storage, run_name, run_id), storage, version)
    except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
        get_run_logger().warning("held-out preview of v%06d not logged: %s", version, exc)


@flow(name="evaluate", flow_run_name="{recipe.name}/{run_name}/eval")
def evaluate_run(recipe: Recipe, run_name: str = "", version: int | None = None) -> dict[str, Any]:
    """Evaluate policy `version` of run `run_name` (default: its last finished iteration)."""
    run_name = run_name or recipe.name
    storage, info = open_run(recipe, run_name)
    if version is None:
        version = storage.last_success() + 1
    if not storage.exists(join(eval_dir(version), "metrics.json")):
        say(f"[unirl] evaluating v{version:06d} of {run_name} on the held-out prompts (greedy, and {recipe.eval.k} samples each) ...")
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

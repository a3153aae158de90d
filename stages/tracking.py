"""MLflow tracking through `MlflowClient` with an explicit run id (the fluent API is not
thread-safe). Default store: SQLite in the run folder for local runs, else ./mlruns.db."""
from __future__ import annotations

import math
import os
from typing import Any

from stages.recipe import Recipe
from stages.storage import RunStorage


def tracking_uri(recipe: Recipe, storage: RunStorage) -> str:
    if recipe.tracking.mlflow_uri:
        return recipe.tracking.mlflow_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.local:
        return f"sqlite:///{storage.local_path('mlflow.db')}"
    return f"sqlite:///{os.path.abspath('mlruns.db')}"


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:6000]
    return out


class Tracker:
    """One MLflow run per unirl run; resumed runs keep logging into the same MLflow run, and a
    step that already has metrics is not logged again."""

    def __init__(self, recipe: Recipe, storage: RunStorage, run_name: str, mlflow_run_id: str | None):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.uri = tracking_uri(recipe, storage)
        self.client = MlflowClient(tracking_uri=self.uri)
        if mlflow_run_id is None:
            exp = self.client.get_experiment_by_name(recipe.tracking.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(recipe.tracking.experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"unirl.run": run_name, "unirl.storage": storage.url()})
            self.run_id = run.info.run_id
            self.log_params(recipe)
        else:
            self.run_id = mlflow_run_id
        self.logged_steps = {m.step for m in self.client.get_metric_history(self.run_id, "time/iteration_s")}

    def log_params(self, recipe: Recipe) -> None:
        from mlflow.entities import Param

        params = flatten("", recipe.model_dump(mode="json"), {})
        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, step: int, metrics: dict[str, float], dedupe: bool = True) -> None:
        """Log `metrics` at `step`; an iteration step already logged (a resumed run) is skipped."""
        import time

        from mlflow.entities import Metric

        if dedupe and step in self.logged_steps:
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if isinstance(v, (int, float)) and math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=items)
        if dedupe:
            self.logged_steps.add(step)

    def log_image(self, step: int, image: Any, key: str) -> str:
        """Log a PIL image as `images/<key>/step-<step>.png` (MLflow's image history under `key`);
        returns the artifact path, for links."""
        path = f"images/{key}/step-{step:06d}.png"
        self.client.log_image(self.run_id, image, artifact_file=path)
        return path

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

    def link(self) -> str:
        return f"{self.uri} run {self.run_id}"

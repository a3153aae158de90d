"""What a training run shows in the Prefect UI: its artifacts.

* `unirl-{run}-iterations`  table, one row per finished iteration (rewards, advantages, loss, KL,
  clip fraction, stage timings); a new version after the first iteration of a flow run, then at
  most every `TABLE_EVERY_S` seconds, and at the end (each version holds the whole table, so one
  per iteration would grow the API's database with the square of the run's length).
* `unirl-{run}-progress`    progress of the run, in percent of `recipe.iterations`.
* `unirl-{run}-mlflow`      link to the MLflow run.
* `unirl-{run}-summary`     markdown at the end: held-out metrics before and after RL (when the
  run evaluates), first vs last iteration, where the weights are.

Artifacts are for people: a failure to create one is logged and never fails the run.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from unirl.stages.recipe import Recipe
from unirl.stages.run.tracking import browse
from unirl.stages.runtime.storage import RunStorage, iter_dir, join

# (column, metric key): the columns of the iterations table, in order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "rollout/reward_mean"),
    ("reward_std", "rollout/reward_std"),
    ("adv_mean", "advantage/mean"),
    ("adv_std", "advantage/std"),
    ("adv_abs_mean", "advantage/abs_mean"),
    ("loss", "train/loss"),
    ("approx_kl", "train/approx_kl"),
    ("kl", "train/kl"),
    ("clip_frac", "train/clip_frac"),
    ("grad_norm", "train/grad_norm"),
    ("generate_s", "time/generate_s"),
    ("score_s", "time/score_s"),
    ("advantage_s", "time/advantage_s"),
    ("train_s", "time/train_s"),
    ("sync_s", "time/sync_s"),
    ("iteration_s", "time/iteration_s"),
)
# Metrics compared first vs last in the summary.
SUMMARY_KEYS = ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean", "train/loss",
                "train/approx_kl", "train/clip_frac", "time/iteration_s")


TABLE_EVERY_S = 30.0


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow only lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    return f"unirl-{slug}-{what}"


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return round(float(value), 6)
    return None


def iteration_row(summary: dict[str, Any]) -> dict[str, Any]:
    """One table row from the summary an `rl-iteration` run returns (also stored in `_SUCCESS`)."""
    metrics = summary.get("metrics", {})
    row: dict[str, Any] = {"iteration": summary["iteration"], "policy_version": summary.get("policy_version")}
    row.update({column: _number(metrics.get(key)) for column, key in COLUMNS})
    return row


def mlflow_link(uri: str, experiment_id: str | None, run_id: str) -> str:
    """A browsable address of the run: an MLflow server's run page, or for a local store the page
    `mlflow ui --backend-store-uri URI` serves (the artifact's description gives the command)."""
    return browse(uri, experiment_id, run_id)[0]


def summary_markdown(recipe: Recipe, run_name: str, storage_url: str, rows: list[dict[str, Any]],
                     first: dict[str, Any], last: dict[str, Any], weights: str | None, checkpoint: str | None,
                     mlflow: str, evals: list[dict[str, Any]] | None = None) -> str:
    """The end-of-run report: held-out metrics of the first and the last evaluated policy, and
    the training metrics of the first and the last iteration, side by side."""
    lines = [
        f"# {recipe.name} / {run_name}",
        "",
        f"{len(rows)} of {recipe.iterations} iterations finished; run folder `{storage_url}`.",
        "",
    ]
    if evals:
        before, after = evals[0], evals[-1]
        lines += [f"| held-out | v{before['version']:06d} | v{after['version']:06d} |", "|---|---|---|"]
        for key in before["metrics"]:
            lines.append(f"| `{key}` | {_fmt(before['metrics'].get(key))} | {_fmt(after['metrics'].get(key))} |")
        lines.append("")
    lines += [
        f"| metric | {iter_dir(first['iteration'])} | {iter_dir(last['iteration'])} |",
        "|---|---|---|",
    ]
    for key in SUMMARY_KEYS:
        a, b = first.get("metrics", {}).get(key), last.get("metrics", {}).get(key)
        if a is None and b is None:
            continue
        lines.append(f"| `{key}` | {_fmt(a)} | {_fmt(b)} |")
    lines += ["", f"* weights: `{weights}`" if weights else "* weights: none published yet",
              f"* checkpoint: `{checkpoint}`" if checkpoint else "* checkpoint: none",
              f"* MLflow: {mlflow}",
              f"* extend: `unirl run RECIPE --run-name {run_name} iterations=N` (N > {recipe.iterations}), or run the "
              f"deployment with `run_name={run_name}` and `iterations=N`"]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "-"


class RunArtifacts:
    """The artifacts of one `rl-train` flow run. Rows of iterations finished before a resume are
    read back from their `_SUCCESS` files, so the table always covers the whole run."""

    def __init__(self, recipe: Recipe, run_name: str, storage: RunStorage, tracker: Any):
        self.recipe = recipe
        self.run_name = run_name
        self.storage = storage
        self.tracker = tracker
        self.summaries: list[dict[str, Any]] = []
        self.progress_id: Any = None
        self.table_rows = 0  # summaries in the last published table
        self.table_at = -math.inf  # when it was published (never yet: the first iteration publishes)
        try:
            self.logger = get_run_logger()
        except Exception:  # noqa: BLE001 - outside a run context: artifacts are skipped anyway
            import logging  # start-up time: loaded on first use

            self.logger = logging.getLogger("unirl.artifacts")

    def _try(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - artifacts never fail a training run
            self.logger.warning("could not write the %s artifact: %s: %s", what, type(exc).__name__, exc)
            return None

    def start(self, first: int) -> None:
        """Before the first iteration of this flow run (`first` > 0 when resuming)."""
        for i in range(first):
            rel = join(iter_dir(i), "_SUCCESS")
            if self.storage.exists(rel):
                self.summaries.append(self.storage.read_json(rel))
        done = len(self.summaries)
        self.progress_id = self._try(
            "progress", create_progress_artifact, progress=self._percent(done),
            key=artifact_key(self.run_name, "progress"), description=self._progress_text(done),
        )
        link, command = self.tracker.page()
        self._try(
            "MLflow link", create_link_artifact, link=link, link_text=f"MLflow run {self.tracker.run_id}",
            key=artifact_key(self.run_name, "mlflow"),
            description=f"MLflow run of {self.run_name} (run id `{self.tracker.run_id}`)"
                        + (f"; serve it first with `{command}`" if command else ""),
        )

    def iteration(self, summary: dict[str, Any]) -> None:
        """After an iteration finished (its `_SUCCESS` is written)."""
        self.summaries.append(summary)
        if time.monotonic() - self.table_at >= TABLE_EVERY_S:
            self.publish_table()
        if self.progress_id is not None:
            done = len(self.summaries)
            self._try("progress", update_progress_artifact, self.progress_id, self._percent(done),
                      description=self._progress_text(done))

    def publish_table(self) -> None:
        """A new version of the iterations table, when it has rows the last one lacks (also for a
        run that stops early: `rl_train` calls it on failure)."""
        if len(self.summaries) == self.table_rows:
            return
        rows = [iteration_row(s) for s in self.summaries]
        self._try(
            "iterations table", create_table_artifact, table=rows, key=artifact_key(self.run_name, "iterations"),
            description=f"{self.recipe.name}/{self.run_name}: metrics per iteration, up to "
                        f"{iter_dir(self.summaries[-1]['iteration'])}",
        )
        self.table_rows, self.table_at = len(self.summaries), time.monotonic()

    def finish(self) -> None:
        """After the last iteration: the whole iterations table and the markdown summary."""
        if not self.summaries:
            return
        self.publish_table()
        last = self.summaries[-1]
        weights = self.storage.weights_versions()
        checkpoints = self.storage.checkpoints()
        markdown = summary_markdown(
            self.recipe, self.run_name, self.storage.url(), [iteration_row(s) for s in self.summaries],
            self.summaries[0], last,
            self.storage.url(self.storage.weights_rel(max(weights))) if weights else None,
            self.storage.url(self.storage.checkpoint_rel(max(checkpoints))) if checkpoints else None,
            self._mlflow_line(), self._evals(),
        )
        self._try("summary", create_markdown_artifact, markdown=markdown, key=artifact_key(self.run_name, "summary"),
                  description=f"{self.recipe.name}/{self.run_name}: before and after")

    def _mlflow_line(self) -> str:
        """The MLflow run's page as a link, and for a local store the command that serves it."""
        link, command = self.tracker.page()
        return f"[run {self.tracker.run_id}]({link})" + (f" (serve the store first: `{command}`)" if command else "")

    def _evals(self) -> list[dict[str, Any]]:
        """Held-out results written by the evaluate task (`eval/vNNNNNN/metrics.json`), by version."""
        found = []
        for name in self.storage.listdir("eval"):
            rel = join("eval", name, "metrics.json")
            if re.fullmatch(r"v\d{6}", name) and self.storage.exists(rel):
                found.append(self.storage.read_json(rel))
        return sorted(found, key=lambda e: e["version"])

    def _percent(self, done: int) -> float:
        return min(100.0, 100.0 * done / self.recipe.iterations)

    def _progress_text(self, done: int) -> str:
        return f"{self.recipe.name}/{self.run_name}: {done} of {self.recipe.iterations} iterations"

"""The readers of a run's events (stages/run/events.py): what a person sees of a run, each in one
place. `train_run` (flows/rl.py) and `evaluate_run` (flows/evaluate.py) subscribe the ones they
want and emit; neither calls a reader.

    Console      the run's lines: the progress line per iteration, each evaluation's  (foreground)
    Mlflow       an iteration's metrics, each evaluation's, the run's end             (background)
    Registry     each published version in the model registry, tagged with its evaluations
    Previews     an iteration's rollouts, a held-out evaluation's samples, in MLflow
    Artifacts    the Prefect artifacts: progress, iterations table, evaluations, summary

Previews and artifacts are for people: they never fail the run.
"""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from unirl.flows.artifacts import RunArtifacts, artifact_key
from unirl.flows.shapes import Models
from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import PREFIX, metrics_line
from unirl.stages.run.events import (
    EvaluationDone,
    EvaluationStarted,
    Event,
    IterationCommitted,
    IterationEnded,
    RunFinished,
    RunStarted,
    VersionPublished,
)
from unirl.stages.run.tracking import Tracker, model_card
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.stages.train.manifests import MANIFEST
from unirl.tasks.console import Progress, say


class Console:
    """The run's own lines, in the loop's order."""

    def __init__(self, recipe: Recipe, run_name: str = ""):
        self.recipe, self.run_name = recipe, run_name
        self.progress: Progress | None = None

    def on(self, event: Event) -> None:
        recipe = self.recipe
        match event:
            case RunStarted(first=first):
                self.progress = Progress(recipe.iterations, first)
            case EvaluationStarted(version=v, split=split, note=note):
                of = f" of {self.run_name}" if self.run_name else ""
                first_ = "the ODE sample (no noise)" if recipe.rollout.kind == "flow" else "greedy"  # what `greedy` is for a flow model
                say(f"[unirl] evaluating v{v:06d}{of} on the {split_name(split)} prompts "
                    f"({note or f'{first_}, and {recipe.eval.k} samples each'}) ...")
            case EvaluationDone(replayed=False, version=v, metrics=m, split=split, label=label, before=before):
                was = f"  (v000000 before RL: {metrics_line(recipe, before, split)})" if before is not None else ""
                say(f"[unirl] {split_name(split)} v{v:06d}{' (' + label + ')' if label else ''}: {metrics_line(recipe, m, split)}{was}")
            case IterationEnded(iteration=i, summary=s) if self.progress is not None:
                self.progress.iteration(i, s["metrics"])  # before its evaluation: the console reads top to bottom
            case RunFinished() if self.progress is not None:
                self.progress.close()


def split_name(split: str) -> str:
    """What the console calls a split: the dev split is the held-out one."""
    return "held-out" if split == "dev" else split


class Mlflow:
    """The run's MLflow run: an iteration's metrics at its step (`time/iteration_s` marks it
    logged), an evaluation's at its version (`eval/*`, `test/*`), system metrics while the run runs,
    the run's status at its end. The tracker logs a step once, so a replay logs nothing twice."""

    def __init__(self, tracker: Tracker, *, finishes: bool = True):
        self.tracker, self.finishes = tracker, finishes

    def on(self, event: Event) -> None:
        match event:
            case RunStarted(first=first) if self.finishes:
                self.tracker.watch_system(resumed=first > 0)
            case IterationCommitted(iteration=i, summary=s, replayed=replayed):
                if not replayed:
                    fault_point("report", i)  # the fault table's kill after a commit, before its report
                self.tracker.log_metrics(i, s["metrics"])
            case EvaluationDone(version=v, metrics=m, split=split, before=before):
                key = f"{PREFIX[split]}/accuracy"
                if before is not None:
                    self.tracker.log_metrics(0, before, key=key)
                self.tracker.log_metrics(v, m, key=key)  # once, also when a killed run had computed it
            case RunFinished(ok=ok) if self.finishes:
                self.tracker.finish("FINISHED" if ok else "FAILED")


class Registry:
    """`tracking.registry`: each model's published weights as a version of its registered model in
    MLflow, its source the weights folder in run storage (a model publishes every
    `checkpoint_every` versions, a frozen one only v000000); each evaluation as tags of the
    versions it evaluated."""

    def __init__(self, recipe: Recipe, tracker: Tracker, run_name: str, models: Models):
        self.recipe, self.tracker, self.run_name, self.models = recipe, tracker, run_name, models

    def on(self, event: Event) -> None:
        if not self.recipe.tracking.registry:
            return
        match event:
            case VersionPublished(version=v):
                self.register(v)
            case EvaluationDone(version=v, metrics=m):
                for name in self.models:
                    self.tracker.tag_version(name, self.run_name, v, m)

    def register(self, version: int) -> None:
        for name, (store, trains, model) in self.models.items():
            rel = store.weights_rel(version)
            if (version == 0 or trains) and store.exists(join(rel, MANIFEST)):
                if not store.exists(join(rel, "MLmodel")):  # what the registry page shows it takes and gives
                    for file, data in model_card(families.get(model.kind), example_prompt(self.recipe)).items():
                        store.write_bytes(join(rel, file), data)
                self.tracker.register_version(name, self.run_name, version, store.url(rel),
                                              store.read_json(join(rel, MANIFEST)))


_EXAMPLES: dict[str, str] = {}  # a prompt source's JSON -> its first training prompt


def example_prompt(recipe: Recipe) -> str:
    """The first training prompt: a registered version's input example (each source built once)."""
    key = recipe.data.model_dump_json()
    if key not in _EXAMPLES:
        _EXAMPLES[key] = str(build_prompt_source(recipe.data).batch(0, 1)[0].text)
    return _EXAMPLES[key]


class Previews:
    """What people should see in MLflow: an iteration's rollouts every `tracking.preview_every`
    iterations, a held-out evaluation's samples (the run's shape draws them: a samples table for
    text, an image grid for flow models, both for composed runs)."""

    def __init__(self, shape: Any, recipe: Recipe, tracker: Tracker, storage: RunStorage):
        self.shape, self.recipe, self.tracker, self.storage = shape, recipe, tracker, storage

    def on(self, event: Event) -> None:
        every = self.recipe.tracking.preview_every
        if not every:
            return
        match event:
            case IterationCommitted(iteration=i) if i % every == 0:
                self._try(f"rollout preview of {iter_dir(i)}", self.shape.preview, i)
            case EvaluationDone(version=v, split="dev"):
                self._try(f"held-out preview of v{v:06d}", self.shape.eval_preview, v)

    def _try(self, what: str, draw: Any, step: int) -> None:
        try:
            draw(self.recipe, self.tracker, self.storage, step)
        except Exception as exc:  # noqa: BLE001 - a preview is for people, not for the run
            get_run_logger().warning("%s not logged: %s", what, exc)


class Artifacts:
    """The Prefect artifacts of the run (flows/artifacts.py) and of its evaluations."""

    def __init__(self, recipe: Recipe, run_name: str, run: RunArtifacts | None = None):
        self.recipe, self.run_name, self.run = recipe, run_name, run

    def on(self, event: Event) -> None:
        run = self.run
        match event:
            case RunStarted(first=first) if run is not None:
                run.start(first)
            case IterationCommitted(replayed=False, summary=s) if run is not None:
                run.iteration(s)  # a replayed one is in the table already (RunArtifacts.start reads it back)
            case EvaluationDone(version=v, metrics=m, split="dev"):
                eval_artifact(self.recipe, self.run_name, v, m)
            case RunFinished(ok=ok) if run is not None:
                run.finish() if ok else run.publish_table()


def eval_artifact(recipe: Recipe, run_name: str, version: int, metrics: dict[str, float]) -> None:
    """Publish an evaluation as a Prefect table artifact."""
    create_table_artifact(
        key=artifact_key(f"{recipe.name}-{run_name}", "eval"),
        table=[{"version": version, **{k.split("/", 1)[1]: round(v, 4) for k, v in metrics.items()}}],
        description=f"held-out evaluation of {run_name} at policy version {version}",
    )

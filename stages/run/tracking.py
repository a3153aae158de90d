"""MLflow tracking through `MlflowClient` with an explicit run id (the fluent API is not
thread-safe). Default store: one SQLite store per local storage root (`<root>/mlflow.db`: every
run of the root in one `mlflow ui`, one experiment per recipe), else ./mlruns.db; a run started
with a store of its own (`<root>/<run>/mlflow.db`, before) keeps it.

MLflow is also the model's home: every published weights version is a version of the registered
model named after the recipe, its source the weights folder in run storage (no second copy),
tagged with the run, iteration, policy version, the manifest's sha256 and, once evaluated, its
held-out metrics; per iteration a small samples table (text) or preview image (flow)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shlex
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.accumulation import closing_iteration
from unirl.stages.runtime.media import Media
from unirl.stages.runtime.secrets import redact_url
from unirl.stages.runtime.storage import RunStorage


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlartifacts` beside the
    database (for a run's own store, in the run folder) instead of MLflow's default, ./mlruns in
    whatever folder the process started in. A tracking server or a folder store decides itself."""
    path = sqlite_path(uri)
    return os.path.join(os.path.dirname(str(path)) or ".", "mlartifacts") if path is not None else None


STORE = "mlflow.db"  # a local storage root's MLflow store (and, before, a run folder's own)


def tracking_uri(recipe: Recipe, storage: RunStorage) -> str:
    """The recipe's `tracking.mlflow_uri`, else $MLFLOW_TRACKING_URI, else the storage root's
    SQLite store (a run folder's own store where it has one), else ./mlruns.db for an object store."""
    if recipe.tracking.mlflow_uri:
        return recipe.tracking.mlflow_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = storage.local_path()
    if folder is not None:
        own = folder / STORE
        return f"sqlite:///{own if own.exists() else folder.parent / STORE}"
    return f"sqlite:///{os.path.abspath('mlruns.db')}"


def experiment_name(recipe: Recipe) -> str:
    return recipe.tracking.experiment or recipe.name


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Held while a process opens a SQLite store the first time: MLflow creates a new store's
    tables on first use, and two runs starting at once on a fresh storage root would both try
    (`<store>.lock`, an advisory lock beside it). Other stores need none."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:6000]
    return out


# MLflow 3's UI opens on GenAI pages unless the address says otherwise (its `workflowType` query
# parameter, else a per-browser setting): a run's page, opened from our links, shows model training.
TRAINING_VIEW = "workflowType=machine_learning"
MLFLOW_PORT = 5000  # where `unirl ui` (and `mlflow ui`) serve when the port is free
MLFLOW_UI = f"http://127.0.0.1:{MLFLOW_PORT}"


def browse(uri: str, experiment_id: str | None, run_id: str) -> tuple[str, str | None]:
    """(the run's page, the command that serves it first or None): an MLflow server's own page; a
    local store (sqlite, a folder) is served by `unirl ui URI` on MLFLOW_UI (on another port when
    that one is taken: it says which)."""

    uri = redact_url(uri)
    page = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id is not None else f"#/runs/{run_id}"
    page += f"?{TRAINING_VIEW}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}", None
    return f"{MLFLOW_UI}/{page}", f"unirl ui {shlex.quote(uri)}"


def model_card(family: Any, example: str) -> dict[str, bytes]:
    """What a registered version shows of what it takes and gives: MLflow's `MLmodel` with the
    signature of a `family` model as unirl samples it (a prompt, and its images for a
    vision-language model; a response for each text policy, a PNG image or a GIF clip for a flow
    policy) and `example` as its input example. Files by name, written beside the weights."""
    from mlflow.models import Model, ModelSignature  # start-up time: mlflow loads on first use, not when a recipe is read
    from mlflow.models.utils import _save_example
    from mlflow.types import ColSpec, Schema

    inputs: list[Any] = [ColSpec("string", "prompt")] + ([ColSpec("binary", "images", required=False)] if family.takes_images else [])
    outputs: list[Any] = []
    for policy in family.offers():
        if policy == "text":
            outputs.append(ColSpec("string", "response"))
        else:
            outputs.append(ColSpec("binary", "video" if "video" in family.produces else "image"))
    model = Model(signature=ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs)))
    with tempfile.TemporaryDirectory(prefix="unirl-card-") as tmp:
        _save_example(model, {"prompt": [example]}, tmp)
        model.save(str(Path(tmp) / "MLmodel"))
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()}


# MLflow 3 opens an experiment of this kind on its training runs (the Runs table, charts), not on
# GenAI traces and evaluations.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def recipe_sha(recipe: Recipe) -> str:
    """sha256 of the recipe as it runs (every field, defaults included): two runs with the same
    value ran the same recipe."""
    return hashlib.sha256(recipe.model_dump_json().encode()).hexdigest()


class Tracker:
    """One MLflow run per unirl run; resumed runs keep logging into the same MLflow run, and a
    step that already has metrics is not logged again."""

    def __init__(self, recipe: Recipe, storage: RunStorage, run_name: str, mlflow_run_id: str | None,
                 tags: dict[str, str] | None = None):
        """`tags`: where this process runs from (the Prefect flow run, deployment, git commit),
        set on a new MLflow run and again on a resumed one (the latest process's)."""
        from mlflow.tracking import MlflowClient  # start-up time: mlflow loads on first use, not when a recipe is read

        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.uri = tracking_uri(recipe, storage)
        self.recipe = recipe
        self.monitor: Any = None
        with store_lock(self.uri):  # a new store's tables (made when a client opens it), and the recipe's experiment, made once
            self.client = MlflowClient(tracking_uri=self.uri)
            exp, exp_id = self.experiment(experiment_name(recipe)) if mlflow_run_id is None else (None, "")
        if mlflow_run_id is None:
            run = self.client.create_run(exp_id, run_name=run_name, tags={
                "unirl.run": run_name, "unirl.storage": storage.url(), "unirl.recipe_sha256": recipe_sha(recipe), **(tags or {})})
            self.run_id = run.info.run_id
            self.log_params(recipe)
        else:
            self.run_id = mlflow_run_id
            exp = self.client.get_experiment(self.client.get_run(mlflow_run_id).info.experiment_id)
            for key, value in (tags or {}).items():
                self.client.set_tag(self.run_id, key, value)
        if exp is not None and exp.tags.get(EXPERIMENT_KIND[0]) is None:  # an older experiment; a user's own kind stays
            self.client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        self.logged_steps: dict[str, set[int]] = {}  # metric key -> steps already in MLflow
        self.tables: list[str] | None = None  # the tables MLflow's table views list (read once, then kept)

    def experiment(self, name: str) -> tuple[Any, str]:
        """(the experiment if it existed, its id): a new one is made with its kind and artifact
        folder; one another run made a moment before (a tracking server) is found."""
        from mlflow.exceptions import MlflowException  # start-up time: mlflow loads on first use, not when a recipe is read

        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp, exp.experiment_id
        try:
            return None, self.client.create_experiment(name, artifact_location=artifact_root(self.uri), tags=dict([EXPERIMENT_KIND]))
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) or (exp := self.client.get_experiment_by_name(name)) is None:
                raise
            return exp, exp.experiment_id

    def log_params(self, recipe: Recipe) -> None:
        from mlflow.entities import Param  # start-up time: mlflow loads on first use, not when a recipe is read

        params = flatten("", recipe.model_dump(mode="json"), {})
        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def has_step(self, step: int, key: str = "time/iteration_s") -> bool:
        """Whether metric `key` has a value at `step` in MLflow (read once per key, then kept)."""
        if key not in self.logged_steps:
            self.logged_steps[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
        return step in self.logged_steps[key]

    def log_metrics(self, step: int, metrics: dict[str, float], key: str = "time/iteration_s") -> None:
        """Log `metrics` at `step` once: when metric `key` already has `step` (a resumed run that
        logged it before it was killed), nothing is logged again."""
        from mlflow.entities import Metric  # start-up time: mlflow loads on first use, not when a recipe is read

        if self.has_step(step, key):
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if isinstance(v, (int, float)) and math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=items)
        if key in metrics:
            self.logged_steps[key].add(step)

    def log_image(self, step: int, image: Any, key: str) -> str:
        """Log a PIL image as `images/<key>/step-<step>.png` (MLflow's image history under `key`);
        returns the artifact path, for links."""
        path = f"images/{key}/step-{step:06d}.png"
        self.client.log_image(self.run_id, image, artifact_file=path)
        return path

    def log_bytes(self, step: int, data: bytes, key: str, ext: str) -> str:
        """Log a file's bytes (an animated GIF preview) as `images/<key>/step-<step>.<ext>`; returns its path."""
        return self.log_file(data, f"images/{key}", f"step-{step:06d}.{ext}")

    def log_table(self, step: int, columns: dict[str, list[Any]], key: str) -> str:
        """Log a table (column -> values) as `tables/<key>/step-<step>.json` in MLflow's table
        layout, listed where MLflow's table views look (the run's `mlflow.loggedArtifacts` tag);
        returns its path. A `Media` value is logged as its own file beside the table and shown as
        an image in its cell (a GIF for a video). Not `MlflowClient.log_table`, which reads the
        run and lists its artifacts on every call, a cost per iteration that grows with the run;
        the tag lists the newest tables that fit MLflow's tag size (older ones stay artifacts)."""
        folder = f"tables/{key}"
        path = f"{folder}/step-{step:06d}.json"
        names = list(columns)
        rows = []
        for r, values in enumerate(zip(*(columns[n] for n in names))):
            row = []
            for name, value in zip(names, values):
                if isinstance(value, Media):
                    media = self.log_file(value.data, f"{folder}/media", f"step-{step:06d}-{r:03d}-{name}.{value.ext}")
                    value = {"type": "image", "filepath": media, "compressed_filepath": media}
                row.append(value)
            rows.append(row)
        self.client.log_dict(self.run_id, {"columns": names, "data": rows}, artifact_file=path)
        self.list_table(path)
        return path

    def log_file(self, data: bytes, folder: str, name: str) -> str:
        with tempfile.TemporaryDirectory(prefix="unirl-artifact-") as tmp:
            local = Path(tmp) / name
            local.write_bytes(data)
            self.client.log_artifact(self.run_id, str(local), artifact_path=folder)
        return f"{folder}/{name}"

    def list_table(self, path: str) -> None:
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS  # start-up time: mlflow loads on first use, not when a recipe is read
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        if self.tables is None:
            listed = json.loads(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
            self.tables = [t["path"] for t in listed if t.get("type") == "table"]
        if path in self.tables:
            return
        self.tables.append(path)
        while len(tag := json.dumps([{"path": p, "type": "table"} for p in self.tables])) > MAX_TAG_VAL_LENGTH:
            self.tables.pop(0)
        self.client.set_tag(self.run_id, MLFLOW_LOGGED_ARTIFACTS, tag)

    # -- the model registry ----------------------------------------------------------------------
    def register_version(self, model: str, run_name: str, policy_version: int, source: str, manifest: dict[str, Any]) -> str:
        """Register published weights `policy_version` of this run as a version of registered model
        `model` (once: a resumed run finds it by its tags); returns the registry version."""
        from mlflow.exceptions import MlflowException  # start-up time: mlflow loads on first use, not when a recipe is read

        found = self.registered_version(model, run_name, policy_version)
        if found is not None:
            return found
        try:
            self.client.create_registered_model(model, tags={"unirl": "true"},
                                                description="Weights versions published by unirl runs of this recipe.")
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        tags = {"unirl.run": run_name, "unirl.policy_version": str(policy_version),
                "unirl.iteration": str(closing_iteration(self.recipe, policy_version)) if policy_version else "initial",
                "unirl.manifest_sha256": digest, "unirl.weights": source}
        mv = self.client.create_model_version(model, source=source, run_id=self.run_id, tags=tags,
                                              description=f"{run_name}: policy version {policy_version} (weights after "
                                              f"{policy_version} train steps) at {source}")
        return str(mv.version)

    def registered_version(self, model: str, run_name: str, policy_version: int) -> str | None:
        from mlflow.exceptions import MlflowException  # start-up time: mlflow loads on first use, not when a recipe is read

        try:
            found = self.client.search_model_versions(f"name = '{model}' and tags.`unirl.run` = '{run_name}' and "
                                                      f"tags.`unirl.policy_version` = '{policy_version}'")
        except MlflowException:
            return None
        return str(found[0].version) if found else None

    def tag_version(self, model: str, run_name: str, policy_version: int, metrics: dict[str, float]) -> bool:
        """Put held-out `metrics` on the registry version of `policy_version` (False: not registered)."""
        version = self.registered_version(model, run_name, policy_version)
        if version is None:
            return False
        for key, value in metrics.items():
            self.client.set_model_version_tag(model, version, key, f"{value:.6g}")
        return True

    def watch_system(self, resumed: bool) -> None:
        """MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network; GPU
        where its library finds one) sampled on a thread into this run until `finish`; a resumed
        run's samples go on after its last step. Off with `tracking.system_metrics: false`."""
        if not self.recipe.tracking.system_metrics or self.monitor is not None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # start-up time: loaded on first use

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start and stop lines are not the run's
        self.monitor = SystemMetricsMonitor(self.run_id, resume_logging=resumed, tracking_uri=self.uri)
        self.monitor.start()

    def finish(self, status: str = "FINISHED") -> None:
        if self.monitor is not None:
            self.monitor.finish()  # its thread stopped, what it sampled logged
            # and one sample of the end, so a run shorter than the sampling interval has one too
            self.monitor.collect_metrics()
            self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            self.monitor.mlflow_logger.flush()
            self.monitor = None
        self.client.set_terminated(self.run_id, status=status)

    def experiment_id(self) -> str | None:
        try:
            return str(self.client.get_run(self.run_id).info.experiment_id)
        except Exception:  # noqa: BLE001 - an address without the experiment is still an address
            return None

    def page(self) -> tuple[str, str | None]:
        """(this run's page, the command that serves its store first or None): `browse`."""
        return browse(self.uri, self.experiment_id(), self.run_id)

    def link(self) -> str:
        """Where a person opens this run: a tracking server's run page, or for a local store the
        command that serves it and the page it then shows (credentials redacted)."""
        page, command = self.page()
        return page if command is None else f"{command}  then {page}"

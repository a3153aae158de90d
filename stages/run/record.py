"""Creating and reopening a run folder: recipe.yaml, run.json and the initial weights v000000."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from unirl.stages.models.family import get_family
from unirl.stages.recipe import FINGERPRINT_SCHEMA, Recipe
from unirl.stages.runtime.accumulation import schedule_steps
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.storage import RunStorage, join
from unirl.stages.train.manifests import MANIFEST, write_weights_dir


class RunMismatchError(ValueError):
    """Resuming a run with a recipe that would change what was already computed."""


class RunFinishedError(ValueError):
    """Starting a run that has finished, without asking to extend it or to resume it."""


def finished_error(recipe: Recipe, run_name: str) -> RunFinishedError | None:
    """The error for starting run `run_name` again once it has finished every one of
    `recipe.iterations` (run.json's `finished_iterations`, written when a run ends well), else None.
    A run killed before its end is not finished: starting it again resumes it. Reads run.json only."""
    storage = RunStorage(recipe.storage.root, run_name, recipe.storage.options)
    if not storage.exists("run.json"):
        return None
    done = storage.read_json("run.json").get("finished_iterations")
    if done is None or recipe.iterations > done:
        return None
    return RunFinishedError(
        f"run {run_name!r} is finished ({done} iterations, {storage.url()}); pass iterations=M with M > {done} to "
        f"extend it or pick another run name; to report it again (its held-out lines, anything MLflow misses) "
        "resume it explicitly (unirl run --resume, or the flow's resume=true)")


def mark_finished(storage: RunStorage, iterations: int) -> dict[str, Any]:
    """What a run that ended well leaves in run.json: how many iterations it finished, and when."""
    return update_run_info(storage, finished_iterations=iterations, finished=datetime.now(timezone.utc).isoformat())


def code_version() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass

    try:
        return version("unirl")
    except PackageNotFoundError:
        return "unknown"


def open_run(recipe: Recipe, run_name: str) -> tuple[RunStorage, dict[str, Any]]:
    """Create the run (or reopen it to resume). A resumed run must have the same recipe
    fingerprint (everything but iterations, storage, tracking, and the ranks it trains on)."""
    storage = RunStorage(recipe.storage.root, run_name, recipe.storage.options)
    if storage.exists("run.json"):
        info = storage.read_json("run.json")
        if "fingerprint_schema" not in info and info["recipe_hash"] == recipe.legacy_fingerprint():
            info.update(recipe_hash=recipe.fingerprint(), fingerprint_schema=FINGERPRINT_SCHEMA)  # a run of before
            storage.write_json("run.json", info)
        if info["recipe_hash"] != recipe.fingerprint():
            raise RunMismatchError(
                f"{storage.url('run.json')}: run {run_name!r} was started with a different recipe "
                f"(see {storage.url('recipe.yaml')}); resume with the same recipe or pick a new --run-name"
            )
        changed = "schedule_steps" not in info  # runs made before it was recorded: their first length
        info.setdefault("schedule_steps", schedule_steps(recipe, info.get("iterations", recipe.iterations)))
        if recipe.iterations != info.get("iterations") or changed:
            info["iterations"] = recipe.iterations
            storage.write_json("run.json", info)
        if storage.read_text("recipe.yaml") != recipe.to_yaml():  # iterations, ranks, storage, tracking
            storage.write_text("recipe.yaml", recipe.to_yaml())
        return storage, info
    info = {
        "run_id": uuid.uuid4().hex, "run_name": run_name, "code_version": code_version(),
        "recipe_hash": recipe.fingerprint(), "fingerprint_schema": FINGERPRINT_SCHEMA, "created": datetime.now(timezone.utc).isoformat(),
        "iterations": recipe.iterations, "schedule_steps": schedule_steps(recipe, recipe.iterations), "mlflow_run_id": None,
    }
    storage.write_text("recipe.yaml", recipe.to_yaml())
    storage.write_json("run.json", info)
    return storage, info


def update_run_info(storage: RunStorage, **fields: Any) -> dict[str, Any]:
    info = storage.read_json("run.json")
    info.update(fields)
    storage.write_json("run.json", info)
    return info


def check_inputs(recipe: Recipe) -> None:
    """The checks of a run's own files that need no model, Prefect or MLflow: `model.path` holds a
    checkpoint of its family, and the prompt source reads (a missing, empty or malformed data file);
    each error names its file. `unirl run` calls this before starting anything."""
    if recipe.model.path:
        with tempfile.TemporaryDirectory() as unused:  # with a path, materialize checks and writes nothing
            get_family(recipe.model.kind).materialize(recipe.model, Path(unused))
    build_prompt_source(recipe.data)


TINY_CACHE_ENV = "UNIRL_TINY_CACHE"


def materialize_model(recipe: Recipe, scratch: Path) -> Path:
    """The folder the run starts from: `model.path` (checked), or the tiny seeded model saved to
    `scratch`. With UNIRL_TINY_CACHE set (the test suite sets it), tiny models are built once per
    `model:` section into that folder and reused: a tiny build is a function of the section alone
    (seeded init), and building one costs a run seconds of imports and init."""
    family = get_family(recipe.model.kind)
    cache = os.environ.get(TINY_CACHE_ENV)
    if recipe.model.path or not cache:
        return family.materialize(recipe.model, scratch)
    return cached_tiny(Path(cache), recipe.model, lambda into: family.materialize(recipe.model, into))


def cached_tiny(cache: Path, cfg: Any, build: Any) -> Path:
    """The cached build of the tiny model of `cfg` (a `model:` section) under `cache`, built by
    `build(folder) -> path` on a miss into a private folder that is then renamed into place (two
    processes racing both build; one rename wins, and both use the winner's folder)."""
    key = hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:20]
    final = cache / key
    done = final / "built.json"
    if not done.exists():
        cache.mkdir(parents=True, exist_ok=True)
        private = cache / f".{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        built = Path(build(private / "model"))
        (private / "built.json").write_text(json.dumps({"path": str(built.relative_to(private))}))
        try:
            private.rename(final)
        except OSError:  # another process's build is in place
            shutil.rmtree(private, ignore_errors=True)
    return final / json.loads(done.read_text())["path"]


def initial_weights(storage: RunStorage, recipe: Recipe) -> str:
    """Relative path of weights v000000: the recipe's `model.path` copied in, or the tiny seeded
    model built and saved in HF layout, so every rank loads through the same from-directory path."""
    rel = storage.weights_rel(0)
    if storage.exists(join(rel, MANIFEST)):
        return rel
    with tempfile.TemporaryDirectory() as tmp:
        src = materialize_model(recipe, Path(tmp) / "tiny")
        write_weights_dir(storage, src, rel, {"version": 0, "source": recipe.model.path or "tiny"})
    return rel

"""Nightly retraining: train the next generation of a run from its latest published weights.

A lineage is a run and the runs retrained from it: `tiny` (trained by `rl-train/tiny`), then
`tiny-r001`, `tiny-r002`, ... Each `retrain` flow run looks at the newest generation:

* finished: start generation k+1 as a new run whose `model.path` is generation k's latest
  `weights/vNNNNNN/` (copied to a local cache first when the run lives on object storage);
* unfinished (cancelled, crashed, or still short of its iterations): resume it.

So a schedule can fire every night, a missed or failed night is picked up the next time, and a
retried flow run never starts a second generation from the same weights.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import uuid
from pathlib import Path
from typing import Annotated, Any

import yaml
from prefect import flow, get_run_logger
from pydantic import Field

from unirl.flows.hooks import stop_matching_workers
from unirl.flows.rl import rl_train
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.train.manifests import MANIFEST, verify_weights_dir


class RetrainError(RuntimeError):
    """The lineage has nothing to retrain from."""


def generation_name(lineage: str, k: int) -> str:
    return lineage if k == 0 else f"{lineage}-r{k:03d}"


def generations(root: str, lineage: str, options: dict[str, Any] | None = None) -> list[tuple[int, RunStorage]]:
    """Existing runs of a lineage (a run exists once its run.json is written), oldest first."""
    pattern = re.compile(rf"^{re.escape(lineage)}-r(\d{{3,}})$")
    base = RunStorage(root, lineage, options)
    found = [(0, base)] if base.exists("run.json") else []
    for name in _run_names(base):
        m = pattern.match(name)
        if m:
            storage = RunStorage(root, name, options)
            if storage.exists("run.json"):
                found.append((int(m.group(1)), storage))
    return sorted(found, key=lambda item: item[0])


def _run_names(storage: RunStorage) -> list[str]:
    """Names of the folders next to a run's folder."""
    parent = posixpath.dirname(storage.base)
    try:
        entries = os.listdir(parent) if storage.local else storage.fs.ls(parent, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return [posixpath.basename(str(e).rstrip("/")) for e in entries]


def is_finished(storage: RunStorage) -> bool:
    info = storage.read_json("run.json")
    return storage.last_success() + 1 >= int(info.get("iterations") or 0)


def cache_dir() -> Path:
    return Path(os.environ.get("UNIRL_CACHE") or Path.home() / ".cache" / "unirl")


def local_weights(storage: RunStorage, version: int) -> Path:
    """A local directory holding weights `version` of a run: the folder itself for local runs,
    else a verified copy in the cache. The path is the same every time (it is part of the new
    run's recipe, so a resumed run must see the same path)."""
    rel = storage.weights_rel(version)
    if (local := storage.local_path(rel)) is not None:
        return local
    url = storage.url(rel)
    target = cache_dir() / "weights" / f"{storage.run}-v{version:06d}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"
    if (target / MANIFEST).exists():
        try:
            verify_weights_dir(target)
            return target
        except Exception:  # noqa: BLE001 - a partial or corrupted copy is fetched again
            shutil.rmtree(target, ignore_errors=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    storage.get_dir(rel, partial)
    verify_weights_dir(partial)
    partial.rename(target)
    return target


def plan(recipe: Recipe, lineage: str) -> dict[str, Any]:
    """What tonight's run is: `{"action": "resume"|"new", "run_name", "recipe", ...}`."""
    root, options = recipe.storage.root, recipe.storage.options
    runs = generations(root, lineage, options)
    if not runs:
        raise RetrainError(
            f"no run {lineage!r} under {RunStorage(root, lineage, options).url()}: train it first "
            f"(`unirl run RECIPE --run-name {lineage}` or the rl-train deployment with run_name={lineage})"
        )
    k, newest = runs[-1]
    if k > 0 and not is_finished(newest):
        stored = yaml.safe_load(newest.read_text("recipe.yaml"))
        resumed = Recipe.model_validate({**stored, "storage": recipe.storage.model_dump(), "tracking": recipe.tracking.model_dump()})
        return {"action": "resume", "run_name": newest.run, "recipe": resumed, "generation": k}
    versions = [v for v in newest.weights_versions() if v > 0]
    if not versions:
        raise RetrainError(
            f"{newest.url()} has published no trained weights yet (only weights/v000000): "
            "let it finish, or lower its checkpoint_every"
        )
    version = max(versions)
    path = local_weights(newest, version)
    model = recipe.model.model_copy(update={"path": str(path)})
    return {
        "action": "new", "run_name": generation_name(lineage, k + 1), "generation": k + 1,
        "recipe": recipe.model_copy(update={"model": model}),
        "source": newest.url(newest.weights_rel(version)),
    }


def _stop_lineage_workers(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed: stop any worker group of the lineage left on this host."""
    params = dict(flow_run.parameters)
    try:
        recipe = Recipe.model_validate(params["recipe"])
        base = RunStorage(recipe.storage.root, params["lineage"], recipe.storage.options).url()
    except Exception:  # noqa: BLE001 - a hook must not raise
        return
    killed = stop_matching_workers(lambda url: url == base or url.startswith(base + "-r"))
    from prefect.logging.loggers import flow_run_logger  # start-up time: prefect loads on first use, not when a recipe is read

    flow_run_logger(flow_run, flow).info("%s: worker groups of lineage %s stopped (%d stray process(es) killed)",
                                         state.name, base, killed)


@flow(name="retrain", flow_run_name="{lineage}/retrain",
      on_cancellation=[_stop_lineage_workers], on_crashed=[_stop_lineage_workers])
def retrain(
    recipe: Recipe, lineage: str, iterations: Annotated[int | None, Field(ge=1)] = None
) -> dict[str, Any]:
    """Train the next generation of `lineage` from its latest published weights, or resume
    the newest generation if it did not finish.

    Args:
        recipe: The recipe of the new generation (`model.path` is set to the source weights);
            `storage` says where the lineage lives.
        lineage: Name of the first run; generations are named `<lineage>-r001`, `-r002`, ...
        iterations: Iterations of the new generation (default: the recipe's).
    """
    logger = get_run_logger()
    if iterations is not None:
        recipe = recipe.model_copy(update={"iterations": iterations})
    step = plan(recipe, lineage)
    if step["action"] == "resume":
        logger.info("resuming unfinished generation %s", step["run_name"])
    else:
        logger.info("generation %s starts from %s", step["run_name"], step["source"])
    result = rl_train(step["recipe"], step["run_name"])
    return {**result, "action": step["action"], "generation": step["generation"], "source": step.get("source")}

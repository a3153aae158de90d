"""Supervised warm start as a Prefect flow: records -> the worker group (FSDP2) trained with
cross-entropy on response tokens -> published as the run's initial weights `weights/v000000`,
a plain Hugging Face folder that is also a valid `model.path` for any RL recipe.

The worker group is started for SFT (its optimizer is the warm start's: `sft.lr`, and the
policy's schedule and EMA) and takes the command
    sft(data: str, steps: int, batch_size: int, seed: int, start_step: int) ->
        {"loss": float, "last_loss": float, "steps": int, "seconds": float}
`data` is the run-relative path of an Arrow shard of records (`prompt` plus `response` text for
language models, or `media_png` image bytes for image models); the batch of step s is a function
of (seed, s), so chunks of steps give the same result as one call.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from unirl.stages.compose import shape_of
from unirl.stages.distill import teacher_recipe, teacher_run
from unirl.stages.models.flow_folder import LATENT_SPACE
from unirl.stages.recipe import MAX_OVERRIDES, Recipe, with_overrides
from unirl.stages.run.record import materialize_model, open_run, update_run_info
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.lease import RunLease
from unirl.stages.runtime.storage import RunStorage, join
from unirl.stages.train.manifests import MANIFEST, write_weights_dir
from unirl.stages.train.sft import write_sft_data
from unirl.stages.workers.group import WorkerGroup, close_group
from unirl.tasks.common import announce, close_engine, node_launcher, staged
from unirl.tasks.console import say

BASE = "sft/base"
CHUNK = 50


def run_sft(recipe: Recipe, storage: RunStorage, tracker: Tracker | None = None) -> dict[str, Any]:
    """SFT of a run (idempotent: done once weights/v000000 exists)."""
    s = recipe.sft
    if s is None:
        raise ValueError("the recipe has no `sft` section; add one (see recipes/ar/quickstart.yaml)")
    logger = get_run_logger()
    target = storage.weights_rel(0)
    if storage.exists(join(target, MANIFEST)):
        return {"weights": target, "reused": True}
    group = WorkerGroup(recipe, storage, init_weights=BASE, log=announce(logger), mode="sft",
                        launch_nodes=node_launcher(recipe, storage.run))
    group.prewarm()  # its imports overlap building the base weights and the SFT data
    try:
        if not storage.exists(join(BASE, MANIFEST)):
            with tempfile.TemporaryDirectory() as tmp:
                write_weights_dir(storage, materialize_model(recipe, Path(tmp) / "base"), BASE,
                                  {"version": 0, "source": recipe.model.path or "tiny"})
        manifest = storage.read_json("sft/manifest.json") if storage.exists("sft/manifest.json") else None
        if manifest is None:
            shape = shape_of(recipe)
            manifest = (shape.sft_data(storage, recipe) if shape is not None else None) or write_sft_data(storage, recipe)
            storage.write_json("sft/manifest.json", manifest)
        joint = "stages" in manifest  # a warm start of several stages on one backbone: a shard per stage
        data: Any = manifest["files"] if joint else manifest["files"][0]
        stages = {"stages": manifest["stages"]} if joint else {}
        group.start(None)
        warm: Any = getattr(recipe.model, "vae_warmup", None)
        warm_steps = warm.resolved_steps(bool(recipe.model.path)) if warm is not None else 0
        if warm_steps:
            say(f"[unirl] sft: the VAE learns the SFT media first ({warm_steps} steps of batch {warm.batch_size}) ...")
        done = 0
        while done < s.steps:
            steps = min(CHUNK, s.steps - done)
            out = group.call("sft", data=data, steps=steps, batch_size=s.batch_size, seed=s.seed, start_step=done, **stages)
            done = out["steps"]
            fault_point("sft")
            if "vae_seconds" in out:
                say(f"[unirl] sft: VAE warm-up done, reconstruction loss {out['vae_loss']:.4f}  {out['vae_seconds']:.1f}s")
            say(f"[unirl] sft step {done}/{s.steps}  loss {out['last_loss']:.4f}  {out['seconds']:.1f}s")
            if tracker is not None:
                tracker.log_metrics(done, {"sft/loss": out["loss"]}, key="sft/loss")
        group.call("publish")
    finally:
        group.stop()
    return {"weights": target, "reused": False}


@flow(name="sft", flow_run_name="{recipe.name}/{run_name}")
def sft(recipe: Recipe, run_name: str = "",
        overrides: Annotated[list[str] | None, Field(max_length=MAX_OVERRIDES)] = None) -> dict[str, Any]:
    """Run only the warm start of `recipe` (its `sft` section) as run `run_name`.

    Args:
        recipe: The whole run; its `sft` section is what runs.
        run_name: Run folder name (default: the recipe's name).
        overrides: `key.sub=value` changes to the recipe, applied as `unirl sft` applies them.
    """
    recipe = with_overrides(recipe, overrides or [])
    if recipe.sft is None:
        raise ValueError("the recipe has no `sft` section; add one (see recipes/ar/quickstart.yaml)")
    run_name = run_name or recipe.name

    with RunLease(RunStorage(recipe.storage.root, run_name, recipe.storage.options), log=lambda m: say(f"[unirl] {m}")):
        storage, info = open_run(recipe, run_name)
        tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
        if info.get("mlflow_run_id") != tracker.run_id:
            update_run_info(storage, mlflow_run_id=tracker.run_id)
        out = run_sft(recipe, storage, tracker)
    say(f"[unirl] sft weights: {storage.url(out['weights'])}")
    return {**out, "storage": storage.url()}


def train_teachers(recipe: Recipe, run_name: str, tracker: Tracker | None = None, init: str = "base") -> None:
    """The teachers a recipe trains at its start (`distill.teachers[].sft`) whose SFT starts from
    `init` (base: before the student's own SFT; student: after it, from its weights/v000000),
    each its own task: an SFT on its domain's data into its run folder (`<run>.teacher-<name>`,
    stages/distill.py), then its accuracy on that domain's dev and test splits, printed and logged
    as `teacher/<name>/eval/*` and `teacher/<name>/test/*` (what the student is measured against)."""
    for t in recipe.distill.teachers if recipe.distill is not None else []:
        if t.sft is not None and t.init == init:
            staged(teacher_sft)(recipe, run_name, t.name, tracker)


@task(name="teacher-sft", task_run_name="teacher-sft-{teacher}", cache_policy=NO_CACHE, tags=["gpu"])
def teacher_sft(recipe: Recipe, run_name: str, teacher: str, tracker: Tracker | None = None) -> dict[str, Any]:
    from unirl.stages.run.evaluation import PREFIX, metrics_line  # start-up time: it loads torch
    from unirl.tasks.evaluate import evaluate

    if recipe.distill is None:
        raise ValueError(f"teacher {teacher!r}: the recipe has no `distill` section naming it")
    config = recipe.distill.get(teacher)
    part = teacher_recipe(recipe, config)
    run = teacher_run(run_name, teacher)
    storage = RunStorage(recipe.storage.root, run, recipe.storage.options)
    if not storage.exists(join(storage.weights_rel(0), MANIFEST)):
        say(f"[unirl] teacher {teacher}: SFT on {part.data.name} ({part.sft.steps} steps) into {storage.url()}")
        if config.init == "student":
            student_base(RunStorage(recipe.storage.root, run_name, recipe.storage.options), storage,
                         part if config.tiny else None)
    out = run_sft(part, storage)
    metrics: dict[str, float] = {}
    try:
        for split in (("dev", "test") if recipe.eval.test else ("dev",)) if recipe.eval.enabled else ():
            m = staged(evaluate)(part, run, 0, split)["metrics"]
            say(f"[unirl] teacher {teacher} {split}: {metrics_line(part, m, split)}")
            metrics.update({f"teacher/{teacher}/{k}": v for k, v in m.items() if k.startswith(PREFIX[split] + "/")})
    finally:
        close_engine(storage.url())
        close_group(storage.url())
    if tracker is not None:
        tracker.log_metrics(0, metrics)
    return {**out, "metrics": metrics}


def student_base(student: RunStorage, teacher: RunStorage, fresh: Recipe | None = None) -> None:
    """A teacher with `init: student` starts its SFT from the student's initial weights: they
    become its run's `sft/base` (copied once; run_sft then finds its base there). `fresh`: the
    teacher's recipe when its `tiny` gives it a transformer of its own: that recipe's base model,
    with the student's VAE, text encoders and tokenizers (a bigger teacher in the student's latent
    space)."""

    if teacher.exists(join(BASE, MANIFEST)):
        return
    source = student.weights_rel(0)
    if not student.exists(join(source, MANIFEST)):
        raise ValueError(f"{student.url(source)}: the student's initial weights are missing; a teacher with `init: "
                         "student` is trained after the student's SFT")
    with tempfile.TemporaryDirectory() as tmp:
        local = student.get_dir(source, Path(tmp) / "student")
        (local / MANIFEST).unlink()
        if fresh is not None:
            built = materialize_model(fresh, Path(tmp) / "fresh")
            for part in sorted(built.iterdir()):
                if part.is_dir() and not part.name.startswith(LATENT_SPACE):
                    shutil.rmtree(local / part.name, ignore_errors=True)
                    shutil.copytree(part, local / part.name)
        write_weights_dir(teacher, local, BASE, {"version": 0, "source": student.url(source)})

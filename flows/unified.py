"""A unified-model run (a recipe with `unified:`) as Prefect flows: `rl-train` runs it (flows/rl.py
hands over here), one `unified-iteration` flow run per iteration, whose task runs are each
stage's:

    generate-ar (plans) -> generate-diffusion (images) -> compose -> score -> advantage
        -> train (the joint step: both stages' losses, one optimizer step) -> sync

One run, one worker group and one line of weights versions (stages/compose/unified.py); the warm start is
the joint SFT of both stages. A run resumes after its last finished iteration, and every task
returns its committed output instead of redoing it.
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow

from unirl.flows.console import say
from unirl.flows.pe import run_stages
from unirl.flows.sft import run_sft
from unirl.stages.compose import pipeline
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.run import initial_weights
from unirl.stages.runtime.tracking import Tracker
from unirl.tasks.common import staged
from unirl.tasks.score import score
from unirl.tasks.sync import sync
from unirl.tasks.train import train
from unirl.tasks.unified import advantages, compose, evaluate_unified, generate_stage

# Each stage's generate under its own name in the flow run (made once: see flows/pe.py NAMED).
NAMED = {f"generate-{side}": generate_stage.with_options(name=f"generate-{side}") for side in pipeline.SIDES}


@flow(name="unified-iteration", flow_run_name="iter-{iteration:06d}")
def unified_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    start = time.perf_counter()
    plans = staged(NAMED["generate-ar"])(recipe, run_name, iteration, "ar")
    images = staged(NAMED["generate-diffusion"])(recipe, run_name, iteration, "diffusion", plans["files"])
    composed = staged(compose)(recipe, run_name, iteration, plans["files"], images["files"])
    scored = staged(score)(recipe, run_name, iteration, composed["files"])
    adv = staged(advantages)(recipe, run_name, iteration, composed["files"], scored["files"])
    trained = staged(train)(recipe, run_name, iteration, plans["files"] + images["files"], adv["files"][0])
    synced = staged(sync)(recipe, run_name, iteration)
    metrics: dict[str, float] = {**scored["metrics"], **adv["metrics"]}
    metrics.update({f"train/{k}": float(v) for k, v in trained["metrics"].items()})
    for side, gen in (("ar", plans), ("diffusion", images)):
        metrics[f"time/generate_{side}_s"] = float(gen.get("seconds", 0.0))
    metrics["time/train_s"] = float(trained.get("seconds", 0.0))
    metrics["time/sync_s"] = float(synced.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return {"iteration": iteration, "metrics": metrics}


def unified_run(recipe: Recipe, run_name: str) -> dict[str, Any]:
    """The body of `rl_train` for a unified recipe, under the run's lease."""

    def warm_start(storage: Any, tracker: Tracker) -> dict[str, Any]:
        if recipe.sft is not None:
            say(f"[unirl] warm start of both stages ({recipe.model.kind}, {recipe.sft.steps} joint steps)")
            run_sft(recipe, storage, tracker)
        else:
            initial_weights(storage, recipe)
        return {recipe.name: (storage, True)}

    return run_stages(recipe, run_name, warm_start, unified_iteration, evaluate_unified, "plans")

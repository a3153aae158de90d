"""The RL training run as Prefect flows: one `rl-train` flow run for the whole run, and one
`rl-iteration` flow run per iteration (named iter-000007) whose tasks are the five stages.

generate -> score -> advantage -> train -> sync, then `_SUCCESS`. A run resumes after its last
finished iteration; every stage returns its committed output instead of recomputing it.
"""
from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from stages.recipe import Recipe
from stages.run import initial_weights, open_run, update_run_info
from stages.storage import iter_dir
from stages.tracking import Tracker
from stages.workers.group import close_group
from tasks.advantage import advantage
from tasks.generate import generate
from tasks.score import score
from tasks.sync import sync
from tasks.train import train

STAGES = ("generate", "score", "advantage", "train", "sync")


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}")
def rl_iteration(recipe: Recipe, run_name: str, iteration: int) -> dict[str, Any]:
    start = time.perf_counter()
    gen = generate(recipe, run_name, iteration)
    scored = score(recipe, run_name, iteration, gen["files"])
    adv = advantage(recipe, run_name, iteration, scored["files"][0])
    trained = train(recipe, run_name, iteration, gen["files"], adv["files"][0])
    synced = sync(recipe, run_name, iteration)
    metrics: dict[str, float] = {}
    metrics.update(scored["metrics"])
    metrics.update(adv["metrics"])
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    for name, manifest in zip(STAGES, (gen, scored, adv, trained, synced)):
        metrics[f"time/{name}_s"] = float(manifest.get("seconds", 0.0))
    metrics["time/iteration_s"] = time.perf_counter() - start
    return {
        "iteration": iteration, "policy_version": synced["policy_version"], "metrics": metrics,
        "checkpoint": synced.get("checkpoint"), "weights": synced.get("weights"),
    }


def progress_line(i: int, total: int, m: dict[str, float]) -> str:
    return (
        f"[unirl] {iter_dir(i)} ({i + 1}/{total})  reward {m['rollout/reward_mean']:.3f}±{m['rollout/reward_std']:.3f}"
        f"  loss {m['train/loss']:+.4f}  kl {m['train/approx_kl']:.2e}  clip {m['train/clip_frac']:.3f}"
        f"  grad {m['train/grad_norm']:.3f}  {m['time/iteration_s']:.1f}s"
    )


@flow(name="rl-train", flow_run_name="{recipe.name}/{run_name}")
def rl_train(recipe: Recipe, run_name: str = "") -> dict[str, Any]:
    """Run (or resume) `recipe` as run `run_name` (default: the recipe's name)."""
    logger = get_run_logger()
    run_name = run_name or recipe.name
    storage, info = open_run(recipe, run_name)
    initial_weights(storage, recipe)
    tracker = Tracker(recipe, storage, run_name, info.get("mlflow_run_id"))
    if info.get("mlflow_run_id") != tracker.run_id:
        info = update_run_info(storage, mlflow_run_id=tracker.run_id)
    first = storage.last_success() + 1
    if first > 0:
        logger.info("resuming %s at %s", storage.url(), iter_dir(first))
    print(f"[unirl] run {run_name} at {storage.url()}  (MLflow {tracker.link()})", flush=True)
    last: dict[str, Any] = {}
    try:
        for i in range(first, recipe.iterations):
            summary = rl_iteration(recipe, run_name, i)
            tracker.log_metrics(i, summary["metrics"])
            storage.mark_success(i, summary)
            print(progress_line(i, recipe.iterations, summary["metrics"]), flush=True)
            last = summary
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        close_group(storage.url())
    tracker.finish()
    return {"run": run_name, "storage": storage.url(), "iterations": recipe.iterations,
            "last": last, "mlflow_run_id": tracker.run_id}

"""The producer of async RL (`rollout.mode: async`): its own long-running Prefect flow run
`rl-producer`, one `produce` task run per iteration's batch, sampling on the dedicated engine
ahead of the trainer. Batch j waits until the trainer has published the version the staleness
bound schedules for it (stages/run/async_rollout.py `behaviour_version`; with partial rollouts one
update ahead, stages/engines/partial.py): the trainer's sync task is the barrier. It resumes at the first batch it had not committed.

    python -m unirl.flows.producer --spec FILE     # as the trainer's run starts it (stages/run/producer_process.py)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from unirl.flows.forms import InnerRecipe
from unirl.stages.recipe import Recipe, build_recipe
from unirl.stages.run.async_rollout import producer_version
from unirl.stages.runtime.storage import join
from unirl.stages.train.manifests import MANIFEST
from unirl.stages.workers.group import die_with_parent
from unirl.tasks.common import close_engine, staged, storage_of
from unirl.tasks.produce import produce


def published(storage: Any, recipe: Recipe, version: int) -> bool:
    """Whether what the engine loads for `version` is published (the trainer's barrier)."""
    lora = recipe.rollout.engine.sync.weights == "lora" and version > 0
    rel = storage.adapters_rel(version) if lora else storage.weights_rel(version)
    return storage.exists(join(rel, MANIFEST))


@flow(name="rl-producer", flow_run_name="{recipe.name}/{run_name}/producer")
def rl_producer(recipe: InnerRecipe, run_name: str, poll_s: float = 0.05) -> dict[str, Any]:
    """Sample every iteration's batch of the run on its engine, up to `rollout.max_staleness`
    updates ahead of the trainer."""
    logger = get_run_logger()
    storage = storage_of(recipe, run_name)
    produced = []
    try:
        for j in range(recipe.iterations):
            if storage.stage_manifest(j, "produce") is not None:
                continue
            version = producer_version(recipe, j)
            start = time.perf_counter()
            while not published(storage, recipe, version):
                time.sleep(poll_s)
            waited = time.perf_counter() - start
            staged(produce)(recipe, run_name, j, version)
            logger.info("iteration %d sampled with policy version %d (waited %.2fs for it)", j, version, waited)
            produced.append(j)
    finally:
        close_engine(storage.url())
    return {"produced": produced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unirl.flows.producer")
    parser.add_argument("--spec", required=True, help="JSON: the recipe and the run name")
    args = parser.parse_args(argv)

    die_with_parent()
    spec = json.loads(Path(args.spec).read_text())
    recipe = build_recipe(spec["recipe"])
    cpus = getattr(recipe.rollout.engine, "cpus", None)
    if cpus:  # the producer is the engine's client: it works where the engine works, not on the trainer's cores
        import os  # start-up time: loaded on first use

        os.sched_setaffinity(0, set(cpus))
    rl_producer(recipe, spec["run_name"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

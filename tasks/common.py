"""What the tasks share: the run's storage and the process-wide worker group of a run."""
from __future__ import annotations

from prefect import get_run_logger

from stages.recipe import Recipe
from stages.storage import RunStorage
from stages.workers.group import WorkerGroup, get_group


def storage_of(recipe: Recipe, run_name: str) -> RunStorage:
    return RunStorage(recipe.storage.root, run_name, recipe.storage.options)


def group_of(recipe: Recipe, storage: RunStorage) -> WorkerGroup:
    def make() -> WorkerGroup:
        logger = get_run_logger()
        return WorkerGroup(recipe, storage, init_weights=storage.weights_rel(0), log=logger.info)

    return get_group(storage.url(), make)

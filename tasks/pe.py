"""A pipeline's own tasks (stages/compose/pipeline.py): each part's generate (the first from the
user's prompts, each later one from the texts of the part before it), compose, and the per-part
advantages. Score, train and sync are the one-model tasks, run on the pipeline (score) or a
part's recipe and run (train, sync), each under its part's name in the flow run."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.compose import members, names, pipeline, upstream_of
from unirl.stages.policies import policies
from unirl.stages.recipe import Recipe
from unirl.stages.runtime import iteration as it
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import engine_of, say_retry, storage_of


def part_version(recipe: Recipe, name: str, iteration: int) -> int:
    """The weights version a part samples iteration `iteration` with: the iteration's (its train
    steps so far), or 0 for a frozen part."""
    return iteration if pipeline.trains(recipe, name) else 0


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate_part(recipe: Recipe, run_name: str, iteration: int, name: str, upstream: list[str] | None = None
                  ) -> dict[str, Any]:
    """The part's requests and rollouts, committed in the part's run: the first part's requests
    are the user's prompts; a later part's, one group per sample in `upstream` (the rollout files
    of the part before it)."""
    part = pipeline.part_recipe(recipe, name, run_name)
    storage = storage_of(part, name)
    up = upstream_of(recipe, name)
    if up is None:
        requests = it.committed(storage, iteration, "requests", lambda: it.write_requests(storage, part, iteration))
    else:
        rel = join(iter_dir(iteration), "requests.arrow")
        requests = it.committed(storage, iteration, "requests", lambda: pipeline.next_requests(
            pipeline.part_storage(recipe, run_name, up), list(upstream or []), storage, iteration, part.rollout.group_size, rel))
    version = part_version(recipe, name, iteration)
    return it.committed(storage, iteration, "generate", lambda: engine_of(part, storage).generate(
        requests["files"][0], join(iter_dir(iteration), "rollouts"), iteration, policy_version=version))


def chain(recipe: Recipe, stores: dict[str, Any], files: dict[str, list[str]]) -> list[tuple[str, str, Any, list[str]]]:
    """What `pipeline.compose` joins: (name, segment kind, storage, rollout files) of each part, in order."""
    return [(m.name, str(policies.get(m.rollout.kind).segment), stores[m.name], files[m.name]) for m in members(recipe)]


@task(name="compose", cache_policy=NO_CACHE)
def compose(recipe: Recipe, run_name: str, iteration: int, files: dict[str, list[str]]) -> dict[str, Any]:
    """iter-N/rollouts/composed.arrow: one row per last-part sample with every part's sample that led to it."""
    storage = storage_of(recipe, run_name)
    stores = {n: pipeline.part_storage(recipe, run_name, n) for n in names(recipe)}
    rel = join(iter_dir(iteration), "rollouts", "composed.arrow")
    return it.committed(storage, iteration, "compose", lambda: pipeline.compose(storage, rel, chain(recipe, stores, files)))


@task(name="advantage", cache_policy=NO_CACHE)
def part_advantages(recipe: Recipe, run_name: str, iteration: int, composed: list[str], rewards: list[str]
                    ) -> dict[str, Any]:
    """Advantages of each trained part within its own groups, in the part's run."""
    storage = storage_of(recipe, run_name)
    parts = {n: pipeline.part_storage(recipe, run_name, n) for n in names(recipe) if pipeline.trains(recipe, n)}
    return it.committed(storage, iteration, "advantage",
                        lambda: pipeline.part_advantages(recipe, storage, iteration, composed, rewards, parts))


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate_pipeline(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    """Held-out results of the pipeline at `version` (each part at its own version: a frozen
    part's is 0): `greedy` is each part's greedy sample (a flow part's by the ODE sampler),
    `sampled` is `eval.k` samples of the first part per prompt and one sample of each later part
    each; both scored on the composed rows (eval/vNNNNNN/<name>/composed.arrow) by the eval
    scorer, against the user's intent."""
    from unirl.stages.runtime.evaluation import eval_dir

    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    parts = {n: pipeline.part_recipe(recipe, n, run_name) for n in names(recipe)}
    stores = {n: storage_of(part, n) for n, part in parts.items()}
    engines = {n: engine_of(part, stores[n]) for n, part in parts.items()}

    def draw(name: str, requests: str, folder: str, greedy: bool) -> list[str]:
        return engines[name].generate(requests, folder, version, policy_version=part_version(recipe, name, version),
                                      greedy=greedy, seed_tag="eval")["files"]

    result = evaluate_composed(recipe, storage, version, parts[names(recipe)[0]], stores, draw, split)
    storage.write_json(rel, result)
    return result


def evaluate_composed(recipe: Recipe, storage: Any, version: int, first: Recipe, stores: dict[str, Any],
                      draw: Any, split: str = "dev") -> dict[str, Any]:
    """Held-out results of a composed model at `version`: `greedy`, every part's greedy sample
    (a flow part's by the ODE sampler), and `sampled`, `eval.k` samples of the first part per
    prompt with one sample of each later part each; both composed
    (eval/vNNNNNN/<name>/composed.arrow) and scored by the eval scorer against the user's intent.
    `draw(part, requests, folder, greedy)` samples a part's requests into files of
    `stores[part]`; `first` is the first part's recipe (its held-out prompts)."""
    from unirl.stages.runtime.evaluation import eval_dir, eval_metrics, write_eval_requests

    order = names(recipe)
    outputs = {}
    for name, size, greedy in (("greedy", 1, True), ("sampled", recipe.eval.k, False)):
        folder = join(eval_dir(version, split), name)
        files: dict[str, list[str]] = {}
        for k, part in enumerate(order):
            if k == 0:
                requests = write_eval_requests(stores[part], first, version, size, name, split)
            else:
                requests = pipeline.next_requests(stores[order[k - 1]], files[order[k - 1]], stores[part], version, 1,
                                                  join(eval_dir(version, split), f"{name}-{part}-requests.arrow"))["files"][0]
            files[part] = draw(part, requests, join(folder, part), greedy)
        outputs[name] = pipeline.compose(storage, join(folder, "composed.arrow"), chain(recipe, stores, files))["files"]
    return {"version": version, "metrics": eval_metrics(storage, recipe, outputs["greedy"], outputs["sampled"], split)}

"""The prompt-enhancer pipeline's own tasks (stages/compose/pipeline.py): each part's generate (the ar part
from the user's prompts, the diffusion part from the rewrites), compose, and the per-part
advantages. Score, train and sync are the one-model tasks, run on the pipeline (score) or a
part's recipe and run (train, sync), each under its part's name in the flow run."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from unirl.stages.compose import pipeline
from unirl.stages.recipe import Recipe
from unirl.stages.runtime import iteration as it
from unirl.stages.runtime.storage import iter_dir, join
from unirl.tasks.common import engine_of, say_retry, storage_of


def part_version(recipe: Recipe, side: str, iteration: int) -> int:
    """The weights version a part samples iteration `iteration` with: the iteration's (its train
    steps so far), or 0 for a frozen part."""
    return iteration if pipeline.trains(recipe, side) else 0


@task(name="generate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def generate_part(recipe: Recipe, run_name: str, iteration: int, side: str, upstream: list[str] | None = None
                  ) -> dict[str, Any]:
    """The part's requests and rollouts, committed in the part's run: the ar part's requests are
    the user's prompts; the diffusion part's, one group per rewrite in `upstream` (the ar part's
    rollout files)."""
    part = pipeline.part_recipe(recipe, side, run_name)
    storage = storage_of(part, side)
    rel = join(iter_dir(iteration), "requests.arrow")
    if side == "ar":
        requests = it.committed(storage, iteration, "requests", lambda: it.write_requests(storage, part, iteration))
    else:
        ar = pipeline.part_storage(recipe, run_name, "ar")
        requests = it.committed(storage, iteration, "requests", lambda: pipeline.flow_requests(
            ar, list(upstream or []), storage, iteration, part.rollout.group_size, rel))
    version = part_version(recipe, side, iteration)
    return it.committed(storage, iteration, "generate", lambda: engine_of(part, storage).generate(
        requests["files"][0], join(iter_dir(iteration), "rollouts"), iteration, policy_version=version))


@task(name="compose", cache_policy=NO_CACHE)
def compose(recipe: Recipe, run_name: str, iteration: int, rewrites: list[str], images: list[str]) -> dict[str, Any]:
    """iter-N/rollouts/composed.arrow: one row per image with the rewrite that caused it."""
    storage = storage_of(recipe, run_name)
    ar, flow = (pipeline.part_storage(recipe, run_name, side) for side in pipeline.SIDES)
    rel = join(iter_dir(iteration), "rollouts", "composed.arrow")
    return it.committed(storage, iteration, "compose", lambda: pipeline.compose(storage, rel, ar, rewrites, flow, images))


@task(name="advantage", cache_policy=NO_CACHE)
def part_advantages(recipe: Recipe, run_name: str, iteration: int, composed: list[str], rewards: list[str]
                    ) -> dict[str, Any]:
    """Advantages of each trained part within its own groups, in the part's run."""
    storage = storage_of(recipe, run_name)
    parts = {side: pipeline.part_storage(recipe, run_name, side) for side in pipeline.SIDES if pipeline.trains(recipe, side)}
    return it.committed(storage, iteration, "advantage",
                        lambda: pipeline.part_advantages(recipe, storage, iteration, composed, rewards, parts))


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"], retries=1, retry_delay_seconds=1,
      retry_condition_fn=say_retry)
def evaluate_pipeline(recipe: Recipe, run_name: str, version: int, split: str = "dev") -> dict[str, Any]:
    """Held-out results of the pipeline at `version` (each part at its own version: a frozen
    part's is 0): `greedy` is the greedy rewrite drawn by the ODE sampler, `sampled` is `eval.k`
    sampled rewrites per prompt, one sampled image each; both scored on the composed rows
    (eval/vNNNNNN/<name>/composed.arrow) by the eval scorer, against the user's intent."""
    from unirl.stages.runtime.evaluation import eval_dir

    storage = storage_of(recipe, run_name)
    rel = join(eval_dir(version, split), "metrics.json")
    if storage.exists(rel):
        return storage.read_json(rel)
    ar, flow = (pipeline.part_recipe(recipe, side, run_name) for side in pipeline.SIDES)
    stores = {"ar": storage_of(ar, "ar"), "diffusion": storage_of(flow, "diffusion")}
    engines = {"ar": engine_of(ar, stores["ar"]), "diffusion": engine_of(flow, stores["diffusion"])}

    def draw(side: str, requests: str, folder: str, greedy: bool) -> list[str]:
        return engines[side].generate(requests, folder, version, policy_version=part_version(recipe, side, version),
                                      greedy=greedy, seed_tag="eval")["files"]

    result = evaluate_composed(recipe, storage, version, ar, stores, draw, split)
    storage.write_json(rel, result)
    return result


def evaluate_composed(recipe: Recipe, storage: Any, version: int, ar: Recipe, stores: dict[str, Any],
                      draw: Any, split: str = "dev") -> dict[str, Any]:
    """Held-out results of a two-stage model at `version`: `greedy`, the greedy text drawn by the
    ODE sampler, and `sampled`, `eval.k` sampled texts per prompt with one sampled image each;
    both composed (eval/vNNNNNN/<name>/composed.arrow) and scored by the eval scorer against the
    user's intent. `draw(side, requests, folder, greedy)` samples a stage's requests into files
    of `stores[side]`; `ar` is the text stage's recipe (its held-out prompts)."""
    from unirl.stages.runtime.evaluation import eval_dir, eval_metrics, write_eval_requests

    outputs = {}
    for name, size, greedy in (("greedy", 1, True), ("sampled", recipe.eval.k, False)):
        folder = join(eval_dir(version, split), name)
        requests = write_eval_requests(stores["ar"], ar, version, size, name, split)
        texts = draw("ar", requests, join(folder, "texts"), greedy)
        drawn = pipeline.flow_requests(stores["ar"], texts, stores["diffusion"], version, 1,
                                       join(eval_dir(version, split), f"{name}-image-requests.arrow"))
        images = draw("diffusion", drawn["files"][0], join(folder, "images"), greedy)
        outputs[name] = pipeline.compose(storage, join(folder, "composed.arrow"), stores["ar"], texts, stores["diffusion"],
                                         images)["files"]
    return {"version": version, "metrics": eval_metrics(storage, recipe, outputs["greedy"], outputs["sampled"], split)}

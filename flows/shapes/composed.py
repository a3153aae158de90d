"""What the composed shapes' iterations share (pipeline.py, unified.py): each part's task under
its own name, the parts' generates in order and what follows them up to the advantages, the
held-out evaluation along the chain, and what people see of composed rollouts."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unirl.stages.compose import members, names
from unirl.stages.compose.chain import compose as compose_rows
from unirl.stages.compose.chain import next_requests
from unirl.stages.diffusion.grid import log_eval_grid, log_grid, rollout_grid
from unirl.stages.recipe import Recipe
from unirl.stages.run.evaluation import eval_dir, eval_metrics, write_eval_requests
from unirl.stages.run.sequence import Batch, Steps, Update, seconds
from unirl.stages.run.tracking import Tracker
from unirl.stages.runtime.registry import policies
from unirl.stages.runtime.sample import read_rollouts, read_shard, scoring_view
from unirl.stages.runtime.storage import RunStorage, join
from unirl.tasks.common import staged
from unirl.tasks.score import score

_NAMED: dict[str, Any] = {}


def named(task: Any, part: str) -> Any:
    """`task` under part `part`'s name in the flow run (`generate-<part>`). Made once per name:
    `staged` keeps its untagged copy of a task by the task's identity, which a task made per call
    would not keep."""
    key = f"{task.name}-{part}"
    if key not in _NAMED:
        _NAMED[key] = task.with_options(name=key)
    return _NAMED[key]


def composed_steps(recipe: Recipe, run_name: str, iteration: int, generate: Any, compose: Any, advantages: Any,
                   update: Callable[[dict[str, list[str]], dict[str, Any]], Update]) -> Steps:
    """A composed iteration's steps: each part's generate in order (a later part's from the samples
    of the one before it), then the composed rows, which are scored; each part's advantages; the
    shape's `update` (train and sync) on each part's samples. Composed runs take no refill round
    (stages/compose/__init__.py refuses dynamic sampling)."""

    def generate_chain(r: int) -> Batch:
        gens: dict[str, Any] = {}
        upstream: list[str] | None = None
        for name in names(recipe):
            gens[name] = staged(named(generate, name))(recipe, run_name, iteration, name, upstream)
            upstream = gens[name]["files"]
        composed = staged(compose)(recipe, run_name, iteration, {name: gen["files"] for name, gen in gens.items()})
        return Batch(list(composed["files"]), {name: list(gen["files"]) for name, gen in gens.items()},
                     times={f"time/generate_{name}_s": seconds(gen) for name, gen in gens.items()})

    return Steps(
        generate=generate_chain,
        score=lambda files, r: staged(score)(recipe, run_name, iteration, files),
        advantage=lambda rewards, composed, taught: staged(advantages)(recipe, run_name, iteration, composed, rewards),
        update=update)


def chain(recipe: Recipe, stores: dict[str, Any], files: dict[str, list[str]]) -> list[tuple[str, str, Any, list[str]]]:
    """What `compose_rows` joins: (name, segment kind, storage, rollout files) of each part, in order."""
    return [(m.name, str(policies.get(m.rollout.kind).segment), stores[m.name], files[m.name]) for m in members(recipe)]


def evaluate_composed(recipe: Recipe, storage: Any, version: int, first: Recipe, stores: dict[str, Any],
                      draw: Any, split: str = "dev") -> dict[str, Any]:
    """Held-out results of a composed model at `version`: `greedy`, every part's greedy sample
    (a flow part's by the ODE sampler), and `sampled`, `eval.k` samples of the first part per
    prompt with one sample of each later part each; both composed
    (eval/vNNNNNN/<name>/composed.arrow) and scored by the eval scorer against the user's intent.
    `draw(part, requests, folder, greedy)` samples a part's requests into files of
    `stores[part]`; `first` is the first part's recipe (its held-out prompts)."""
    order = names(recipe)
    outputs = {}
    for name, size, greedy in (("greedy", 1, True), ("sampled", recipe.eval.k, False)):
        folder = join(eval_dir(version, split), name)
        files: dict[str, list[str]] = {}
        for k, part in enumerate(order):
            if k == 0:
                requests = write_eval_requests(stores[part], first, version, size, name, split)
            else:
                requests = next_requests(stores[order[k - 1]], files[order[k - 1]], stores[part], version, 1,
                                                  join(eval_dir(version, split), f"{name}-{part}-requests.arrow"))["files"][0]
            files[part] = draw(part, requests, join(folder, part), greedy)
        outputs[name] = compose_rows(storage, join(folder, "composed.arrow"), chain(recipe, stores, files))["files"]
    return {"version": version, "metrics": eval_metrics(storage, recipe, outputs["greedy"], outputs["sampled"], split)}


def nothing_early(recipe: Recipe, storage: RunStorage) -> None:
    return None


def composed_preview(table: str) -> Callable[[Recipe, Tracker, RunStorage, int], str | None]:
    """A shape's preview of an iteration's composed rollouts: the grid of its images, each captioned
    with the user's prompt, its text and reward, and the table of every text beside its prompt and
    reward (tables/<table>/step-N.json: `rewrites`, `plans`)."""

    def preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, iteration: int) -> str | None:
        composed_, scored = storage.stage_manifest(iteration, "compose"), storage.stage_manifest(iteration, "score")
        if composed_ is None or scored is None:
            return None  # not committed (a preview is for people)
        composed, rewards = composed_["files"], scored["files"][0]
        grid = log_grid(tracker, iteration, rollout_grid(storage, composed, rewards), "rollouts")
        tracker.log_table(iteration, text_table(storage, composed, rewards, grid), table)
        return grid

    return preview


def text_table(storage: RunStorage, composed: list[str], rewards: str, grid: str) -> dict[str, list[Any]]:
    """Every composed row of an iteration as a table row: the user's prompt, the text beside it,
    the reward of its image, and the grid artifact that shows the first images."""
    table = scoring_view(read_rollouts(storage, composed, columns=["sample_id", "prompt", "text"]))
    shard = read_shard(storage, rewards, "rewards")
    reward = dict(zip(shard.column("sample_id").to_pylist(), shard.column("reward").to_pylist()))
    ids = table.column("sample_id").to_pylist()
    return {"sample_id": ids, "prompt": table.column("prompt").to_pylist(), "rewrite": table.column("text").to_pylist(),
            "reward": [reward[s] for s in ids], "grid": [grid] * len(ids)}


def composed_eval_preview(recipe: Recipe, tracker: Tracker, storage: RunStorage, version: int) -> str | None:
    return log_eval_grid(tracker, storage, version)

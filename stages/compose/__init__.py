"""Composed runs: a prompt-enhancer pipeline (two models in sequence, pipeline.py) and a unified
model (one backbone, two losses, unified.py). Each part (stage) of a composed recipe is also a
one-model recipe (`part_of`), which its policy, algorithm, prompt source and tasks read; each
composed shape registers the validator `unirl validate` runs on its recipes (`checks`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unirl.stages.runtime.registry import Registry

# The sides of both composed shapes, in sampling order, and the policy each side samples with.
SIDES = ("ar", "diffusion")
POLICY_OF = {"ar": "text", "diffusion": "flow"}


def segment_of(side: str) -> str:
    """The segment kind side `side` produces and trains (its policy's: `text`, `latent`)."""
    from unirl.stages.policies import policies

    return str(policies.get(POLICY_OF[side]).segment)


# recipe shape -> its recipe's errors (one `field.path: ...` line each); run by Recipe's validator
checks: Registry[Callable[[Any], list[str]]] = Registry("composed recipe shape", "unirl.stages.compose", "recipe")


def part_of(recipe: Any, side: str, *, model: Any, rollout: dict[str, Any], upstream: Any, train: Any, sft: Any,
            algorithm: Any, data: Any, scored: bool, storage_root: str | None = None) -> Any:
    """The one-model recipe of part `side` of a composed recipe: the recipe's seed, advantages,
    storage, tracking (no previews, no registry: the composed run does those) and counts, with
    the part's model, sampling, optimizer, warm start, algorithm and data. A part that samples
    from an `upstream` part's outputs takes one prompt per upstream sample; a part that is not
    `scored` scores nothing itself (`constant`: its reward is what it leads to)."""
    from unirl.stages.recipe import Recipe

    if upstream is not None:
        rollout = {**rollout, "prompts_per_iteration": upstream.prompts_per_iteration * upstream.group_size}
    storage = recipe.storage.model_dump(mode="json")
    data_: dict[str, Any] = {
        "name": f"{recipe.name}-{side}", "seed": recipe.seed, "model": model.model_dump(mode="json"), "rollout": rollout,
        "train": train.model_dump(mode="json"), "sft": sft, "data": data.model_dump(mode="json"),
        "reward": recipe.reward.model_dump(mode="json") if scored else {"scorers": [{"name": "constant"}]},
        "advantage": recipe.advantage.model_dump(mode="json"),
        "storage": storage if storage_root is None else {**storage, "root": storage_root},
        "tracking": {**recipe.tracking.model_dump(mode="json"), "preview_every": 0, "registry": False},
        "eval": {"enabled": False}, "iterations": recipe.iterations, "checkpoint_every": recipe.checkpoint_every,
    }
    if algorithm is not None:
        data_["algorithm"] = algorithm.model_dump(mode="json")
    return Recipe.model_validate(data_)


def per_part_errors(recipe: Any, names: tuple[str, ...], section: str, sides: tuple[str, ...], what: str,
                    part: str = "part") -> list[str]:
    """A top-level section a composed recipe gives per part (a unified model's: per stage) instead, set anyway."""
    from unirl.stages.recipe import Recipe

    defaults = Recipe()
    where = ", ".join(f"{section}.{side}.<name>" for side in sides)
    return [f"{name}: {what} gives it per {part} ({where.replace('<name>', name)}); remove the top-level one"
            for name in names if getattr(recipe, name) != getattr(defaults, name)]


def sequential_errors(section: str, side: str, rollout: Any, why: str) -> list[str]:
    """Sampling a composed part cannot do: its parts sample each iteration in order."""
    errors = []
    if rollout.mode != "sync":
        errors.append(f"{section}.{side}.rollout.mode: {why}; async rollout is not offered (set it to sync)")
    if rollout.dynamic_sampling is not None:
        errors.append(f"{section}.{side}.rollout.dynamic_sampling: not offered for composed runs (a refill would "
                      "redraw the other part too); remove it")
    return errors


def parts_errors(section: str, sides: tuple[str, ...], build: Callable[[str], Any]) -> list[str]:
    """Each part's one-model recipe's own errors, under the part's section."""
    from pydantic import ValidationError

    from unirl.stages.recipe import format_errors

    errors: list[str] = []
    for side in sides:
        try:
            build(side)
        except ValidationError as exc:
            errors += [f"{section}.{side}.{line}" for line in format_errors(exc)]
    return errors

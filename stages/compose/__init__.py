"""Composed runs, as data in the recipe's `compose` section: a pipeline (models in sequence,
pipeline.py) and a unified model (one backbone in stages, one joint loss, unified.py). Parts
(stages) are named by the recipe and run in its order: the first samples from the user's
prompts, each later one from the texts of the one before it. Each part of a composed recipe is
also a one-model recipe (`part_of`), which its policy, algorithm, prompt source and tasks read.

A composed shape is one module of this package registering a `Shape` under its `compose.kind`:
its recipe section (`config`, a member of the `compose` union), what `unirl validate` reports of
its recipes (`errors`), and, for a shape whose stages share one worker group's backbone, the
policies that group runs and their joint warm start. Its Prefect side (tasks, iteration flow)
is one module of flows/shapes/, since stages/ never imports Prefect.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from unirl.stages.runtime.registry import policies, shapes


class Shape(ABC):
    """A composed shape of run (the `compose.kind` it is registered under)."""

    # Its `compose` section: `kind: Literal[<name>]`, its members' list (named by `members_field`)
    # and the top-level sections its members carry instead (`replaces`).
    config: ClassVar[type]

    @classmethod
    @abstractmethod
    def errors(cls, recipe: Any) -> list[str]:
        """What `unirl validate` reports of its recipes, one `field.path: ...` line each."""

    @classmethod
    def group_stages(cls, recipe: Any) -> dict[str, tuple[Any, float]] | None:
        """The policies one worker group runs on a shared backbone, by stage: (the stage's
        one-model recipe, its loss weight), in order; None: each part has its own group."""
        return None

    @classmethod
    def sft_data(cls, storage: Any, recipe: Any) -> dict[str, Any] | None:
        """The joint warm start's records of a shape whose stages share a backbone (files and the
        stage of each); None: the one-model warm start."""
        return None


def shape_of(recipe: Any) -> type[Shape] | None:
    """The registered shape of a composed recipe (None: a single model)."""
    return None if recipe.compose is None else shapes.get(recipe.compose.kind)


def members(recipe: Any) -> list[Any]:
    """The parts (a pipeline's) or stages (a unified model's) of a composed recipe, in order."""
    compose = recipe.compose
    assert compose is not None, "a composed recipe has a compose section"
    return list(getattr(compose, compose.members_field))


def names(recipe: Any) -> list[str]:
    """The names of a composed recipe's parts (stages), in sampling order."""
    return [m.name for m in members(recipe)]


def member(recipe: Any, name: str) -> tuple[int, Any]:
    """(index, section) of the part (stage) called `name`."""
    for i, m in enumerate(members(recipe)):
        if m.name == name:
            return i, m
    raise ValueError(f"the composed recipe has no part {name!r} (it has {', '.join(names(recipe))})")


def upstream_of(recipe: Any, name: str) -> str | None:
    """The part whose samples part `name` samples from (None: the first part, from the user's prompts)."""
    i, _ = member(recipe, name)
    return None if i == 0 else members(recipe)[i - 1].name


def prompts_per_iteration(recipe: Any, name: str) -> int:
    """How many prompts part `name` samples from per iteration: the first part's, times the group
    size of every part before it (one group per sample of the part before)."""
    i, _ = member(recipe, name)
    parts = members(recipe)
    n = parts[0].rollout.prompts_per_iteration
    for part in parts[:i]:
        n *= part.rollout.group_size
    return int(n)


def where(recipe: Any, name: str) -> str:
    """The recipe path of part `name`: `compose.parts.0`, `compose.stages.1`."""
    i, _ = member(recipe, name)
    return f"compose.{recipe.compose.members_field}.{i}"


def text_policies() -> list[str]:
    """The policy kinds whose samples are text another part can take as its prompts."""
    return [n for n, p in policies.items() if "text" in p.columns]


def part_of(recipe: Any, name: str, *, model: Any, rollout: dict[str, Any], train: Any, sft: Any,
            algorithm: Any, data: Any, storage_root: str | None = None) -> Any:
    """The one-model recipe of part `name` of a composed recipe: the recipe's seed, advantages,
    storage, tracking (no previews, no registry: the composed run does those) and counts, with
    the part's model, sampling, optimizer, warm start, algorithm and data. A part that samples
    from the part before it takes one prompt per sample of that part (`prompts_per_iteration`); a
    part before the last scores nothing itself (`constant`: its reward is
    what it leads to)."""
    from unirl.stages.recipe import Recipe  # at call time: recipe imports this module while it loads

    i, _ = member(recipe, name)
    if i > 0:
        rollout = {**rollout, "prompts_per_iteration": prompts_per_iteration(recipe, name)}
    scored = i == len(members(recipe)) - 1
    storage = recipe.storage.model_dump(mode="json")
    data_: dict[str, Any] = {
        "name": f"{recipe.name}-{name}", "seed": recipe.seed, "model": model.model_dump(mode="json"), "rollout": rollout,
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


def per_part_errors(recipe: Any, what: str) -> list[str]:
    """A top-level section a composed recipe gives per part instead (its section's `replaces`), set anyway."""
    from unirl.stages.recipe import Recipe  # at call time: recipe imports this module while it loads

    defaults = Recipe()
    each = ", ".join(f"{where(recipe, n)}.<name>" for n in names(recipe))
    return [f"{field}: {what} gives it per part ({each.replace('<name>', field)}); remove the top-level one"
            for field in recipe.compose.replaces if getattr(recipe, field) != getattr(defaults, field)]


def chain_errors(recipe: Any, policy_of: Callable[[str], str]) -> list[str]:
    """Parts that cannot feed the next: every part but the last must write text (the next part's
    prompts). `policy_of(name)`: the policy kind part `name` samples with."""
    texts = text_policies()
    out = []
    for name in names(recipe)[:-1]:
        if policy_of(name) not in texts:
            nxt = names(recipe)[names(recipe).index(name) + 1]
            out.append(f"{where(recipe, name)}: part {name!r} samples with the {policy_of(name)} policy, whose samples "
                       f"are not text, so part {nxt!r} cannot take them as prompts; only the last part may be of a "
                       f"policy other than {', '.join(texts)}")
    return out


def sequential_errors(recipe: Any, name: str, rollout: Any, why: str) -> list[str]:
    """Sampling a composed part cannot do: its parts sample each iteration in order."""
    errors = []
    if rollout.mode != "sync":
        errors.append(f"{where(recipe, name)}.rollout.mode: {why}; async rollout is not offered (set it to sync)")
    if rollout.dynamic_sampling is not None:
        errors.append(f"{where(recipe, name)}.rollout.dynamic_sampling: not offered for composed runs (a refill would "
                      "redraw the other parts too); remove it")
    return errors


def duplicate_errors(recipe: Any) -> list[str]:
    """Two parts (stages) with one name: their folders, columns and metrics would collide."""
    section = f"compose.{recipe.compose.members_field}"
    first: dict[str, int] = {}
    out = []
    for i, name in enumerate(names(recipe)):
        if name in first:
            out.append(f"{section}.{i}.name: {name!r} is also {section}.{first[name]}'s name; give each its own")
        first.setdefault(name, i)
    return out


def parts_errors(recipe: Any, build: Callable[[str], Any]) -> list[str]:
    """Each part's one-model recipe's own errors, under the part's path."""
    from pydantic import ValidationError  # start-up time: pydantic loads on first use, not when a recipe is read

    from unirl.stages.recipe import format_errors  # at call time: recipe imports this module while it loads

    errors: list[str] = []
    for name in names(recipe):
        try:
            build(name)
        except ValidationError as exc:
            errors += [f"{where(recipe, name)}.{line}" for line in format_errors(exc)]
    return errors

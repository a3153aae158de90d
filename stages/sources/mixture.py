"""`data.name: mixture`: several prompt sources (domains) in one run, each with its weight, its
own reward scorers and, optionally, its teacher (docs/distillation.md).

Iteration i's `prompts_per_iteration` prompts are split over the domains by weight (largest
remainder, ties to the earlier domain; a domain whose share rounds to 0 this iteration gets its
turn in a later one, since the remainders carry over as a running total), and each domain draws
its count from its own source at data position i. Every prompt records its domain
(`metadata.domain`) and its id names it (`add.it000003-00001`), so a group never spans domains;
the held-out splits are the domains' own, concatenated in order.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.data import Prompt
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source

DOMAIN_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_DOMAINS = 16


class Domain(Section):
    """One prompt source of a mixture."""

    name: str = Field(description="Domain name (lowercase letters, digits, '_'): rows record it, metrics are reported "
                      "per domain under it (`rollout/<name>/reward_mean`, `eval/<name>/accuracy`).")
    weight: float = Field(1.0, gt=0, description="Share of each iteration's prompts (weights are normalised).")
    data: Any = Field(description="The domain's prompt source: a `data` section of its own (`{name: arithmetic, ...}`).")
    scorers: list[Any] | None = Field(
        None, description="The domain's reward scorers (as reward.scorers); empty: reward.scorers. The first is its "
        "held-out correctness scorer unless eval.scorer is set.")
    teacher: str | None = Field(None, description="The name of a `distill.teachers` entry that teaches this domain.")

    @field_validator("name")
    @classmethod
    def _plain(cls, name: str) -> str:
        if not DOMAIN_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a domain name; use lowercase letters, digits and '_' (at most 32, "
                             "starting with a letter)")
        return name

    @field_validator("data", mode="before")
    @classmethod
    def _source(cls, data: Any) -> Any:
        if isinstance(data, Section):
            return data
        if not isinstance(data, dict) or "name" not in data:
            raise ValueError("a domain's data is a data section naming its source, e.g. {name: arithmetic}")
        if data["name"] == "mixture":
            raise ValueError("a domain's data cannot be a mixture itself; list its sources as domains")
        return sources.get(str(data["name"])).config.model_validate(data)

    @field_validator("scorers", mode="before")
    @classmethod
    def _scorers(cls, scorers: Any) -> Any:
        if scorers is None:
            return None
        from unirl.stages.sections import ScorerSpec  # at call time: sections imports this module while it loads

        if not isinstance(scorers, list) or not scorers:
            raise ValueError("a domain's scorers are a non-empty list like reward.scorers (or leave it out)")
        return [s if isinstance(s, ScorerSpec) else ScorerSpec.model_validate(s) for s in scorers]


class MixtureData(Section):
    """Several prompt sources in one run; `prompts_per_iteration` is split over them by weight."""

    name: Literal["mixture"] = "mixture"
    domains: list[Domain] = Field(min_length=1, max_length=MAX_DOMAINS, description="The domains, in order.")

    @model_validator(mode="after")
    def _distinct(self) -> MixtureData:
        seen: set[str] = set()
        for i, d in enumerate(self.domains):
            if d.name in seen:
                raise ValueError(f"data.domains.{i}.name: {d.name!r} names two domains; give each its own name")
            seen.add(d.name)
        return self

    def domain(self, name: str) -> Domain:
        for d in self.domains:
            if d.name == name:
                return d
        raise KeyError(f"data.domains: no domain {name!r} (domains: {', '.join(d.name for d in self.domains)})")


def shares(weights: list[float], iteration: int, n: int) -> list[int]:
    """How many of iteration `iteration`'s `n` prompts each domain gets: the running totals
    round(n * (iteration + 1) * w) - round(n * iteration * w) by largest remainder, so every
    iteration has exactly n and each domain's long-run share is its weight."""
    total = sum(weights)

    def upto(k: int) -> list[int]:  # prompts per domain over the first k iterations, summing to n*k
        exact = [n * k * w / total for w in weights]
        counts = [int(e) for e in exact]
        order = sorted(range(len(weights)), key=lambda j: (-(exact[j] - counts[j]), j))
        for j in order[: n * k - sum(counts)]:
            counts[j] += 1
        return counts

    before, after = upto(iteration), upto(iteration + 1)
    return [a - b for a, b in zip(after, before)]


class Mixture:
    """The prompt source of a mixture: its domains' sources, each prompt named and tagged by its domain."""

    def __init__(self, cfg: MixtureData):
        self.cfg = cfg
        self.sources = {d.name: sources.get(d.data.name).build(d.data) for d in cfg.domains}

    @staticmethod
    def _tag(domain: str, prompts: list[Prompt]) -> list[Prompt]:
        return [Prompt(f"{domain}.{p.prompt_id}", p.text, {**p.metadata, "domain": domain}, p.images) for p in prompts]

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        counts = shares([d.weight for d in self.cfg.domains], iteration, n)
        out: list[Prompt] = []
        for d, k in zip(self.cfg.domains, counts):
            if k:
                out += self._tag(d.name, self.sources[d.name].batch(iteration, k))
        return out

    def heldout(self, split: str = "dev") -> list[Prompt]:
        return [p for d in self.cfg.domains for p in self._tag(d.name, self.sources[d.name].heldout(split))]


@sources.register("mixture")
class MixtureSource(Source):
    name = "mixture"
    config = MixtureData

    @classmethod
    def build(cls, cfg: MixtureData) -> Any:
        return Mixture(cfg)

    @classmethod
    def check(cls, recipe: Any) -> None:
        for d in recipe.data.domains:
            sources.get(d.data.name).check(recipe.model_copy(update={"data": d.data}))

    @classmethod
    def gives_images(cls, cfg: MixtureData) -> bool:
        return any(sources.get(d.data.name).gives_images(d.data) for d in cfg.domains)

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` records split over the domains by weight, each domain's own."""
        counts = shares([d.weight for d in recipe.data.domains], 0, recipe.sft.examples)
        out: list[dict[str, Any]] = []
        for d, k in zip(recipe.data.domains, counts):
            if k:
                part = recipe.model_copy(update={"data": d.data, "sft": recipe.sft.model_copy(update={"examples": k})})
                out += sources.get(d.data.name).sft_records(part)
        return out

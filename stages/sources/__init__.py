"""The prompt-source seam: one file per data source, registering a `Source` with its recipe
section (`data: {name: ...}`). A source yields `stages.data.Prompt`s deterministically from
(seed, iteration), so the data position of a run is its iteration number, plus a fixed held-out
split, and the synthetic demonstrations of a warm start (`sft.source: synthetic`)."""
from __future__ import annotations

import random
from typing import Any, ClassVar

from stages.config_base import Section
from stages.registry import Registry

sources: Registry[type["Source"]] = Registry("prompt source", "stages.sources", "data.name")


class Source:
    name: ClassVar[str]
    config: ClassVar[type[Section]]

    @classmethod
    def build(cls, cfg: Any) -> Any:
        """The prompt source: `batch(iteration, n)` and `heldout()`, lists of `Prompt`."""
        raise NotImplementedError

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe reading this source; ValueError('field.path: ...')."""

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` synthetic (prompt, answer) records from the training stream (never the
        held-out split): the reference answers are the demonstrations; `sft.noise` of them end in
        a stray '=' (an imperfect teacher's format slip)."""
        prompts = cls.build(recipe.data).batch(0, recipe.sft.examples)
        missing = [p.prompt_id for p in prompts if "answer" not in p.metadata]
        if missing:
            raise ValueError(f"sft.source: synthetic records need an answer per prompt; {missing[0]!r} has none")
        rng = random.Random(f"sft-noise-{recipe.sft.seed}")
        return [
            {"prompt": p.text, "response": str(p.metadata["answer"]) + ("=" if rng.random() < recipe.sft.noise else "")}
            for p in prompts
        ]

"""The prompt-source seam: one file per data source, registering a `Source` with its recipe
section (`data: {name: ...}`). A source yields `unirl.stages.runtime.data.Prompt`s deterministically from
(seed, iteration), so the data position of a run is its iteration number, plus two fixed held-out
splits that training never yields, `dev` and `test`, disjoint from each other, and the synthetic
demonstrations of a warm start (`sft.source: synthetic`)."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.data import Prompt, check_split
from unirl.stages.runtime.registry import sources as sources  # re-exported: entries register here
from unirl.stages.runtime.seeds import derive_seed


class Source:
    name: ClassVar[str]
    config: ClassVar[type[Section]]
    # The format slip of the imperfect teacher of `sft.noise` (appended to a demonstration).
    slip: ClassVar[str] = "="

    @classmethod
    def build(cls, cfg: Any) -> Any:
        """The prompt source: `batch(iteration, n)` and `heldout(split)` (`dev`, `test`), lists of `Prompt`."""
        raise NotImplementedError

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe reading this source; ValueError('field.path: ...')."""

    @classmethod
    def gives_images(cls, cfg: Any) -> bool:
        """Whether the prompts of this source (with these settings) carry images."""
        return False

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` synthetic (prompt, answer) records from the training stream (never the
        held-out splits), with the prompts' images where they have some: the reference answers are
        the demonstrations; `sft.noise` of them end in the source's `slip` (an imperfect teacher's
        format slip: a stray '=' by default)."""
        prompts = cls.build(recipe.data).batch(0, recipe.sft.examples)
        missing = [p.prompt_id for p in prompts if "answer" not in p.metadata]
        if missing:
            raise ValueError(f"sft.source: synthetic records need an answer per prompt; {missing[0]!r} has none")
        rng = random.Random(f"sft-noise-{recipe.sft.seed}")
        records = [
            {"prompt": p.text, "response": str(p.metadata["answer"]) + (cls.slip if rng.random() < recipe.sft.noise else "")}
            for p in prompts
        ]
        for record, p in zip(records, prompts):
            if p.images:
                record["images"] = list(p.images)
        return records


def check_listed_prompts(prompts: list[str], parse: Callable[[str], Any], split_of: Callable[[str], str]) -> None:
    """`data.prompts` of a procedural source: each must parse and be of the train split (the
    held-out ones are what dev and test evaluate on), else ValueError naming the entry."""
    for i, text in enumerate(prompts):
        try:
            parse(text)
        except ValueError as exc:
            raise ValueError(f"data.prompts.{i}: {exc}") from None
        if split_of(text) != "train":
            raise ValueError(f"data.prompts.{i}: {text!r} is a held-out prompt (dev and test evaluate on them); list "
                             "prompts of the train split")


class ProceduralPrompts:
    """Prompts of a generator (`sample(n, seed, split=)` -> texts; its `train`, `dev` and `test`
    splits are disjoint): training prompts by (seed, iteration) from its train split, or `prompts`
    cycled in order; fixed dev and test sets of `heldout_size` prompts each from its dev and test
    splits. The test set is drawn when first asked for, so a generator without test prompts for
    some settings fails only whoever evaluates on them. `meta(text)`: each prompt's metadata (what
    its scorer reads)."""

    def __init__(self, sample: Callable[..., list[str]], *, heldout_size: int, seed: int, prompts: list[str],
                 meta: Callable[[str], dict[str, Any]] = lambda text: {}):
        self._sample, self._meta = sample, meta
        self.seed, self.prompts, self.heldout_size = seed, list(prompts), heldout_size
        self._splits: dict[str, list[Prompt]] = {}
        self.heldout("dev")

    def heldout(self, split: str = "dev") -> list[Prompt]:
        if check_split(split) not in self._splits:
            # dev keeps the seed the single held-out split had; test draws with its own.
            seed, prefix = (self.seed, "heldout") if split == "dev" else (derive_seed(self.seed, "test") & 0xFFFFFFFF, "test")
            texts = self._sample(self.heldout_size, seed, split=split) if self.heldout_size else []
            self._splits[split] = [Prompt(f"{prefix}-{i:05d}", t, self._meta(t)) for i, t in enumerate(texts)]
        return list(self._splits[split])

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        if self.prompts:
            texts = [self.prompts[(iteration * n + i) % len(self.prompts)] for i in range(n)]
        else:
            texts = self._sample(n, derive_seed(self.seed, "train", iteration) & 0xFFFFFFFF, split="train")
        return [Prompt(f"it{iteration:06d}-{i:05d}", t, self._meta(t)) for i, t in enumerate(texts)]

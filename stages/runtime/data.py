"""Prompts and where they come from: a recipe's `data` section names a registered prompt source
(stages/sources/: arithmetic, file, geneval). Each yields `Prompt`s deterministically from
(seed, iteration), so the data position of a run is its iteration number and a resumed run sees
the same prompts, and two fixed held-out splits that training never yields: `dev` (what recipes
are tuned on and runs report) and `test` (reported after RL), disjoint from each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unirl.stages.runtime.registry import sources


@dataclass(frozen=True)
class Prompt:
    """One prompt and what its scorers need to know about it (e.g. the `answer`); `images`: the
    PNG bytes it is conditioned on, for vision-language models (stages/runtime/images.py)."""

    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[bytes, ...] = ()


HELDOUT_SPLITS = ("dev", "test")


def check_split(split: str) -> str:
    """`split` if it names a held-out split (a source's `heldout(split)`), else ValueError."""
    if split not in HELDOUT_SPLITS:
        raise ValueError(f"unknown held-out split {split!r} (allowed: {', '.join(HELDOUT_SPLITS)})")
    return split


def build_prompt_source(config: Any) -> Any:
    """The recipe's prompt source: `batch(iteration, n)` and `heldout(split)` (`dev`, `test`) lists
    of `Prompt`."""
    return sources.get(config.name).build(config)

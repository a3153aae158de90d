"""Prompts and where they come from: a recipe's `data` section names a registered prompt source
(stages/sources/: arithmetic, file, geneval). Each yields `Prompt`s deterministically from
(seed, iteration), so the data position of a run is its iteration number and a resumed run sees
the same prompts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt and what its scorers need to know about it (e.g. the `answer`); `images`: the
    PNG bytes it is conditioned on, for vision-language models (stages/images.py)."""

    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[bytes, ...] = ()


def build_prompt_source(config: Any) -> Any:
    """The recipe's prompt source: `batch(iteration, n)` and `heldout()` lists of `Prompt`."""
    from stages.sources import sources

    return sources.get(config.name).build(config)

"""Prompt sources (arithmetic: stages/arithmetic.py; files: stages/data_files.py; toy GenEval
below). Each yields `Prompt`s deterministically from (seed, iteration), so the data
position of a run is its iteration number and a resumed run sees the same prompts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt and what its scorers need to know about it (e.g. the `answer`)."""

    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


class GenEvalPrompts:
    """Toy-GenEval prompts: training prompts by (seed, iteration) from the train split; a fixed
    held-out set from the held-out split. Metadata carries the prompt for the detector."""

    def __init__(self, *, heldout_size: int = 32, seed: int = 0):
        from stages.geneval.dataset import sample_prompts

        self._sample = sample_prompts
        self.seed = seed
        texts = sample_prompts(heldout_size, seed, split="heldout") if heldout_size else []
        self._heldout = [Prompt(f"heldout-{i:05d}", t, {"geneval_prompt": t}) for i, t in enumerate(texts)]

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        texts = self._sample(n, derive_int(self.seed, "train", iteration), split="train")
        return [Prompt(f"it{iteration:06d}-{i:05d}", t, {"geneval_prompt": t}) for i, t in enumerate(texts)]


def derive_int(*parts: object) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def build_prompt_source(config: Any) -> Any:
    """The recipe's prompt source: `batch(iteration, n)` and `heldout()` lists of `Prompt`."""
    if config.name == "arithmetic":
        from stages.arithmetic import arithmetic_source

        return arithmetic_source(config)
    if config.name == "file":
        from stages.data_files import file_prompt_source

        return file_prompt_source(config)
    if config.name == "geneval":
        return GenEvalPrompts(heldout_size=config.heldout_size, seed=config.seed)
    raise ValueError(f"data.name: unknown prompt source {config.name!r} (allowed: arithmetic, file, geneval)")

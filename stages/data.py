"""Prompt sources. Each yields `Prompt`s deterministically from (seed, iteration), so the data
position of a run is its iteration number and a resumed run sees the same prompts."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt and what its scorers need to know about it (e.g. the `answer`)."""

    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


class ArithmeticPrompts:
    """`a+b=` style prompts with the exact integer answer. The held-out split is a fixed set of
    prompts that the training stream never yields."""

    def __init__(self, *, digits: int = 1, operators: list[str] = ("+",), heldout_size: int = 16, seed: int = 0):
        self.digits = digits
        self.operators = list(operators)
        self.seed = seed
        self._heldout = self._draw(random.Random(f"heldout-{seed}"), heldout_size, set(), "heldout", distinct=True)
        self._heldout_texts = {p.text for p in self._heldout}

    def _one(self, rng: random.Random) -> tuple[str, str]:
        lo = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        hi = 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op = rng.choice(self.operators)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}=", str(value)

    def _draw(self, rng: random.Random, n: int, exclude: set[str], prefix: str, distinct: bool) -> list[Prompt]:
        space = len(self.operators) * (10**self.digits) ** 2
        if (distinct and n > space) or space <= len(exclude):
            raise ValueError(
                f"data: {space} possible prompts cannot give {n} distinct held-out prompts and still leave "
                "training prompts; raise data.digits or lower data.heldout_size"
            )
        out: list[Prompt] = []
        seen: set[str] = set()
        while len(out) < n:
            text, answer = self._one(rng)
            if text in exclude or (distinct and text in seen):
                continue
            seen.add(text)
            out.append(Prompt(f"{prefix}-{len(out):05d}", text, {"answer": answer}))
        return out

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        """The `n` training prompts of `iteration` (same result on every call)."""
        rng = random.Random(f"train-{self.seed}-{iteration}")
        return self._draw(rng, n, self._heldout_texts, f"it{iteration:06d}", distinct=False)


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


def build_prompt_source(config: Any) -> ArithmeticPrompts | GenEvalPrompts:
    if config.name == "arithmetic":
        return ArithmeticPrompts(
            digits=config.digits, operators=config.operators, heldout_size=config.heldout_size, seed=config.seed
        )
    if config.name == "geneval":
        return GenEvalPrompts(heldout_size=config.heldout_size, seed=config.seed)
    raise ValueError(f"data.name: unknown prompt source {config.name!r} (allowed: arithmetic, geneval)")

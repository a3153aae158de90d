"""Echo: write back the digits of the prompt (`40715=` -> `40715`), with long-tailed lengths: most
prompts are a few digits, a fraction `long_frac` are long. A task whose responses are mostly
short with a long tail, for what partial rollouts are about (stages/engines/partial.py): in a batch,
the few long answers hold everyone back.

The held-out splits are fixed sets of distinct strings drawn once from the seed (`dev`, then
`test` among those dev did not take), never yielded for training (a training draw that is one is
drawn again: the held-out sets take many of the few short strings, so about a fifth of the
training prompts are long at long_frac 0.15); the training prompts of an iteration depend only on
(seed, iteration).
"""
from __future__ import annotations

import random

from unirl.stages.runtime.data import Prompt, check_split


class Echo:
    """Digit strings of 1..`short` digits, or with probability `long_frac` of `short`+1..`long`."""

    def __init__(self, *, short: int = 3, long: int = 24, long_frac: float = 0.15, heldout_size: int = 20, seed: int = 0):
        if not 1 <= short < long:
            raise ValueError(f"data.long: {long} must be above data.short ({short}), which must be at least 1")
        if not 0.0 <= long_frac <= 1.0:
            raise ValueError(f"data.long_frac: {long_frac} is not a fraction in [0, 1]")
        if 2 * heldout_size >= 10 ** short // 2:
            raise ValueError(f"data.heldout_size: two held-out splits of {heldout_size} strings leave too few short strings "
                             f"of at most {short} digits for training; lower it or raise data.short")
        self.short, self.long, self.long_frac, self.seed = short, long, long_frac, seed
        dev = self._draw(random.Random(f"echo-dev-{seed}"), heldout_size, set(), "heldout")
        test = self._draw(random.Random(f"echo-test-{seed}"), heldout_size, {p.metadata["answer"] for p in dev}, "test")
        self._splits = {"dev": dev, "test": test}
        self._heldout = {p.metadata["answer"] for p in dev + test}

    def _one(self, rng: random.Random) -> str:
        n = rng.randint(self.short + 1, self.long) if rng.random() < self.long_frac else rng.randint(1, self.short)
        return "".join(rng.choice("0123456789") for _ in range(n))

    def _draw(self, rng: random.Random, n: int, exclude: set[str], prefix: str, distinct: bool = True) -> list[Prompt]:
        out: list[Prompt] = []
        seen: set[str] = set()
        while len(out) < n:
            digits = self._one(rng)
            if digits in exclude or (distinct and digits in seen):
                continue
            seen.add(digits)
            out.append(Prompt(f"{prefix}-{len(out):05d}", f"{digits}=", {"answer": digits}))
        return out

    def heldout(self, split: str = "dev") -> list[Prompt]:
        return list(self._splits[check_split(split)])

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        """The `n` training prompts of `iteration` (same result on every call)."""
        return self._draw(random.Random(f"echo-train-{self.seed}-{iteration}"), n, self._heldout, f"it{iteration:06d}",
                          distinct=False)

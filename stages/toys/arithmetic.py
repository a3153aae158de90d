"""Synthetic arithmetic prompts: `a+b=`, `12*3-40+7=`, or any template around the expression.

The answer is the exact integer value with the usual precedence (`*` before `+`/`-`). The
held-out splits are two fixed sets of distinct expressions, drawn once from the seed, that the
training stream never yields: `dev` first, then `test` among the expressions dev did not take;
the training prompts of an iteration depend only on (seed, iteration), so a resumed run sees the
same prompts.
"""
from __future__ import annotations

import random

from unirl.stages.runtime.data import Prompt, check_split

OPERATORS = ("+", "-", "*")


def evaluate(values: list[int], operators: list[str]) -> int:
    """The value of v0 o0 v1 o1 v2 ... with `*` binding tighter than `+` and `-`."""
    terms, signs = [values[0]], []
    for op, v in zip(operators, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            signs.append(op)
            terms.append(v)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def render(values: list[int], operators: list[str]) -> str:
    """`3+(-2)*4`: negative operands are parenthesised so the text reads back unambiguously."""
    parts = [str(values[0]) if values[0] >= 0 else f"({values[0]})"]
    for op, v in zip(operators, values[1:]):
        parts.append(op + (str(v) if v >= 0 else f"({v})"))
    return "".join(parts)


class Arithmetic:
    """Arithmetic prompts with 2-4 operands.

    digits: operands are drawn uniformly from the `digits`-digit numbers (0-9 for one digit,
      10-99 for two, ...); `min_value` / `max_value` override either end of that range
      (negative values allowed).
    operators: drawn independently for each gap between operands.
    template: the prompt text; `{expr}` is replaced by the expression (e.g. "What is {expr}? Answer: ").
    Metadata: `answer` (the integer as text) and `expr` (the bare expression).
    """

    def __init__(
        self,
        *,
        digits: int = 1,
        operators: list[str] | tuple[str, ...] = ("+",),
        operands: int = 2,
        min_value: int | None = None,
        max_value: int | None = None,
        heldout_size: int = 16,
        seed: int = 0,
        template: str = "{expr}=",
    ):
        if digits < 1:
            raise ValueError(f"data.digits: must be at least 1, got {digits}")
        if not 2 <= operands <= 4:
            raise ValueError(f"data.operands: must be 2, 3 or 4, got {operands}")
        unknown = [op for op in operators if op not in OPERATORS]
        if not operators or unknown:
            raise ValueError(f"data.operators: {list(operators)!r} (allowed: {', '.join(OPERATORS)})")
        if "{expr}" not in template:
            raise ValueError(f"data.template: {template!r} has no {{expr}} placeholder")
        if heldout_size < 0:
            raise ValueError(f"data.heldout_size: must be >= 0, got {heldout_size}")
        self.lo = (0 if digits == 1 else 10 ** (digits - 1)) if min_value is None else min_value
        self.hi = 10**digits - 1 if max_value is None else max_value
        if self.lo > self.hi:
            raise ValueError(f"data.min_value: {self.lo} is above data.max_value {self.hi}")
        self.operators = list(operators)
        self.operands = operands
        self.template = template
        self.seed = seed
        self.space = len(set(self.operators)) ** (operands - 1) * (self.hi - self.lo + 1) ** operands
        if 2 * heldout_size >= self.space:
            raise ValueError(
                f"data.heldout_size: {self.space} possible expressions cannot give two disjoint held-out splits "
                f"(dev and test) of {heldout_size} distinct prompts and still leave training prompts; lower "
                "data.heldout_size, or widen data.digits / min_value / max_value, or add operands"
            )
        dev = self._draw(random.Random(f"heldout-{seed}"), heldout_size, set(), "heldout", distinct=True)
        dev_exprs = {p.metadata["expr"] for p in dev}
        test = self._draw(random.Random(f"test-{seed}"), heldout_size, dev_exprs, "test", distinct=True)
        self._splits = {"dev": dev, "test": test}
        self._heldout_exprs = dev_exprs | {p.metadata["expr"] for p in test}

    def _one(self, rng: random.Random) -> tuple[str, str]:
        # Values first, then operators.
        values = [rng.randint(self.lo, self.hi) for _ in range(self.operands)]
        ops = [rng.choice(self.operators) for _ in range(self.operands - 1)]
        return render(values, ops), str(evaluate(values, ops))

    def _draw(self, rng: random.Random, n: int, exclude: set[str], prefix: str, distinct: bool) -> list[Prompt]:
        out: list[Prompt] = []
        seen: set[str] = set()
        while len(out) < n:
            expr, answer = self._one(rng)
            if expr in exclude or (distinct and expr in seen):
                continue
            seen.add(expr)
            text = self.template.replace("{expr}", expr)
            out.append(Prompt(f"{prefix}-{len(out):05d}", text, {"answer": answer, "expr": expr}))
        return out

    def heldout(self, split: str = "dev") -> list[Prompt]:
        """The fixed `dev` or `test` split: distinct expressions, none in the other split, never
        yielded by `batch`."""
        return list(self._splits[check_split(split)])

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        """The `n` training prompts of `iteration` (same result on every call)."""
        rng = random.Random(f"train-{self.seed}-{iteration}")
        return self._draw(rng, n, self._heldout_exprs, f"it{iteration:06d}", distinct=False)


def arithmetic_source(config) -> Arithmetic:
    """Build from a recipe's `data` section (fields added after ArithmeticData's first version
    fall back to their defaults when absent)."""
    return Arithmetic(
        digits=config.digits,
        operators=list(config.operators),
        operands=getattr(config, "operands", 2),
        min_value=getattr(config, "min_value", None),
        max_value=getattr(config, "max_value", None),
        heldout_size=config.heldout_size,
        seed=config.seed,
        template=getattr(config, "template", "{expr}="),
    )

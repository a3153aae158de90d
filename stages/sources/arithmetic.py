"""`data.name: arithmetic`: synthetic arithmetic prompts (stages/toys/arithmetic.py)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source
from unirl.stages.toys.arithmetic import arithmetic_source


class ArithmeticData(Section):
    """Synthetic arithmetic prompts (`a+b=`, `12*3-40=`); the answer is the exact integer result."""

    name: Literal["arithmetic"] = "arithmetic"
    digits: int = Field(1, ge=1, le=6, description="Digits per operand (0-9 for 1, 10-99 for 2, ...).")
    operators: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    operands: int = Field(2, ge=2, le=4, description="Numbers per expression; `*` binds tighter than `+` and `-`.")
    min_value: int | None = Field(None, description="Smallest operand, overriding the low end of `digits` (may be negative).")
    max_value: int | None = Field(None, description="Largest operand, overriding the high end of `digits`.")
    template: str = Field("{expr}=", description="Prompt text; `{expr}` is replaced by the expression, e.g. 'What is {expr}? '.")
    heldout_size: int = Field(16, ge=0, description="Size of each of the dev and test splits (never trained on).")
    seed: int = Field(1234, ge=0, description="Seed of the prompt stream and the dev and test splits.")

    @model_validator(mode="after")
    def _check_space(self) -> ArithmeticData:
        if "{expr}" not in self.template:
            raise ValueError(f"data.template: {self.template!r} has no {{expr}} placeholder")
        lo = (0 if self.digits == 1 else 10 ** (self.digits - 1)) if self.min_value is None else self.min_value
        hi = 10**self.digits - 1 if self.max_value is None else self.max_value
        if lo > hi:
            raise ValueError(f"data.min_value: {lo} is above the largest operand {hi}")
        space = len(set(self.operators)) ** (self.operands - 1) * (hi - lo + 1) ** self.operands
        if 2 * self.heldout_size >= space:
            raise ValueError(
                f"data.heldout_size: two held-out splits (dev and test) of {self.heldout_size} prompts leave none of "
                f"the {space} possible expressions for training; lower it or widen digits / min_value / max_value / operands"
            )
        return self


@sources.register("arithmetic")
class ArithmeticSource(Source):
    name = "arithmetic"
    config = ArithmeticData

    @classmethod
    def build(cls, cfg: ArithmeticData) -> Any:
        return arithmetic_source(cfg)

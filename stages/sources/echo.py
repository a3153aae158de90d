"""`data.name: echo`: write back the prompt's digits, with long-tailed lengths (stages/toys/echo.py)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source
from unirl.stages.toys.echo import Echo


class EchoData(Section):
    """Digit strings to write back (`40715=` -> `40715`): mostly short, a fraction long."""

    name: Literal["echo"] = "echo"
    short: int = Field(3, ge=1, le=12, description="Most strings have 1..short digits.")
    long: int = Field(24, ge=2, le=4096, description="A long string has short+1..long digits.")
    long_frac: float = Field(0.15, ge=0, le=1, description="Fraction of prompts with a long string.")
    heldout_size: int = Field(20, ge=0, description="Size of each of the dev and test splits (never trained on).")
    seed: int = Field(1234, ge=0, description="Seed of the prompt stream and the dev and test splits.")


@sources.register("echo")
class EchoSource(Source):
    name = "echo"
    config = EchoData

    @classmethod
    def build(cls, cfg: EchoData) -> Any:
        return Echo(short=cfg.short, long=cfg.long, long_frac=cfg.long_frac, heldout_size=cfg.heldout_size, seed=cfg.seed)

    @classmethod
    def check(cls, recipe: Any) -> None:
        cap = getattr(recipe.rollout, "max_new_tokens", None)
        if cap is not None and cap <= recipe.data.long:
            raise ValueError(f"rollout.max_new_tokens: {cap} cannot hold an answer of data.long {recipe.data.long} digits and "
                             f"its end of sequence; set it to at least {recipe.data.long + 1}")

"""Deterministic text scorers with no model: `text_length`, `constant`, `keyword`.

They are cheap real rewards (length shaping, keyword presence) and the known-value scorers the
reward-server tests and benchmark aggregate by hand.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer


def _texts(batch: ScoreBatch, field: str, scorer: str) -> list[str]:
    if field == "prompt":
        return batch.prompts
    if field != "text":
        raise ValueError(f"scorer {scorer!r}: field must be 'text' or 'prompt', got {field!r}")
    if batch.texts is None:
        raise ValueError(f"scorer {scorer!r} needs decoded text (ScoreBatch.texts) and the batch has none")
    return batch.texts


@register_scorer("text_length", reads=("text",))
class TextLength:
    """Length of the text in characters (or whitespace-separated words with `unit: words`).

    Normalization: none by default (score = length >= 0); with `max_length` the score is
    min(length, max_length) / max_length, in [0, 1].
    """

    name = "text_length"

    def __init__(self, unit: Literal["chars", "words"] = "chars", max_length: int | None = None, field: str = "text") -> None:
        if unit not in ("chars", "words"):
            raise ValueError(f"scorer 'text_length': unit must be 'chars' or 'words', got {unit!r}")
        if max_length is not None and max_length <= 0:
            raise ValueError(f"scorer 'text_length': max_length must be positive, got {max_length}")
        self.unit, self.max_length, self.field = unit, max_length, field

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        texts = _texts(batch, self.field, self.name)
        lengths = np.array(
            [len(t) if self.unit == "chars" else len(t.split()) for t in texts], dtype=np.float64
        )
        if self.max_length is not None:
            lengths = np.minimum(lengths, self.max_length) / self.max_length
        return ScoreResult(lengths)


@register_scorer("constant", reads=())
class Constant:
    """The same `value` for every sample (a baseline, or a known value in tests). No normalization."""

    name = "constant"

    def __init__(self, value: float = 0.0) -> None:
        self.value = float(value)

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        return ScoreResult(np.full(len(batch), self.value, dtype=np.float64))


@register_scorer("keyword", reads=("text",))
class Keyword:
    """Fraction of `keywords` found as substrings of the text: score in [0, 1].

    Case-insensitive unless `case_sensitive`. Component `hits`: how many keywords were found.
    """

    name = "keyword"

    def __init__(self, keywords: list[str], case_sensitive: bool = False, field: str = "text") -> None:
        if not keywords:
            raise ValueError("scorer 'keyword' needs at least one keyword")
        self.case_sensitive, self.field = case_sensitive, field
        self.keywords = [k if case_sensitive else k.casefold() for k in keywords]

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        texts = _texts(batch, self.field, self.name)
        hits = np.array(
            [
                sum(k in (t if self.case_sensitive else t.casefold()) for k in self.keywords)
                for t in texts
            ],
            dtype=np.float64,
        )
        return ScoreResult(hits / len(self.keywords), {"hits": hits})

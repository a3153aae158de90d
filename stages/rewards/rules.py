"""Rule-based scorers for text answers."""
from __future__ import annotations

import re

import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer

_INTEGER = re.compile(r"-?\d+")


def extract_answer(text: str) -> str:
    """The model's answer: the text up to the end-of-sequence marker, without surrounding space."""
    return text.strip()


@register_scorer("exact_match", reads=("text",))
class ExactMatch:
    """1.0 when the response equals the sample's `answer` metadata exactly (after stripping
    surrounding whitespace), else 0.0. A sample without an `answer` is an error naming it."""

    name = "exact_match"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.texts is None:
            raise ValueError("exact_match needs decoded texts")
        scores = np.zeros(len(batch), dtype=np.float64)
        for i, (text, meta) in enumerate(zip(batch.texts, batch.metadata)):
            if "answer" not in meta:
                raise ValueError(f"sample {batch.sample_ids[i]!r} has no 'answer' metadata")
            scores[i] = float(extract_answer(text) == str(meta["answer"]).strip())
        return ScoreResult(scores)


@register_scorer("integer_format", reads=("text",))
class IntegerFormat:
    """1.0 when the response (stripped) is a signed integer such as `12` or `-3`, else 0.0:
    a format reward that gives an untrained model a signal before it gets answers right."""

    name = "integer_format"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.texts is None:
            raise ValueError("integer_format needs decoded texts")
        return ScoreResult(np.array([float(_INTEGER.fullmatch(t.strip()) is not None) for t in batch.texts]))


@register_scorer("tool_success", reads=("transcript",))
class ToolSuccess:
    """An agent's tool use, read from its transcript: the share of its tool calls that came back
    without an error (a malformed call, a tool that raised, timed out or died counts against it);
    `no_calls` for a trajectory that called nothing. A shaping term beside a task's own scorer."""

    name = "tool_success"

    def __init__(self, no_calls: float = 0.0):
        self.no_calls = float(no_calls)

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.transcripts is None:
            raise ValueError("tool_success reads an agent's transcripts: give the recipe an `agent` section")
        scores = np.zeros(len(batch), dtype=np.float64)
        for i, turns in enumerate(batch.transcripts):
            calls = [t for t in turns if t.get("role") == "tool"]
            scores[i] = sum(t.get("error") is None for t in calls) / len(calls) if calls else self.no_calls
        return ScoreResult(scores)

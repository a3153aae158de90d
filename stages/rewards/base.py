"""The scorer interface every reward speaks, the registry that builds scorers by recipe name,
and the aggregation of several scorers into one reward.

A scorer takes a `ScoreBatch` (prompts, decoded text and/or images/video frames, per-sample
metadata) and returns a `ScoreResult`: one finite float per sample plus optional named components.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# re-exported: scorers register here
from unirl.stages.runtime.scorers import (  # noqa: F401
    MODALITIES,
    ScorerEntry,
    build_scorer,
    check_scorer_params,
    prompt_check,
    register_scorer,
    scorer_names,
    scorer_reads,
)

AGGREGATIONS = ("weighted_sum", "mean", "min", "max")


@dataclass
class ScoreBatch:
    """What a scorer sees. Every list has one entry per sample, in `sample_ids` order.

    `images` holds PIL images (RGB); `videos` holds one list of PIL frames per sample.
    `metadata` carries the data source's per-sample fields (e.g. `answer` for arithmetic).
    `transcripts` (agentic runs, for scorers that read "transcript"): each sample's turns, dicts with
    `role` ("assistant" or "tool"), `text`, and for tool turns `tool`, `arguments` (JSON), `result`
    and `error` (stages/tools/agent.py `transcript_of`).
    """

    sample_ids: list[str]
    prompts: list[str]
    texts: list[str] | None = None
    images: list[Any] | None = None
    videos: list[list[Any]] | None = None
    metadata: list[dict[str, Any]] = field(default_factory=list)
    finish_reasons: list[str] | None = None
    transcripts: list[list[dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        if not self.metadata:
            self.metadata = [{} for _ in range(n)]
        for name in ("prompts", "texts", "images", "videos", "metadata", "finish_reasons", "transcripts"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"ScoreBatch.{name} has {len(value)} entries for {n} samples")

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass
class ScoreResult:
    """`scores`: (N,) float64. `components`: name -> (N,) float64, logged as `reward/<name>`."""

    scores: np.ndarray
    components: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def mean_of(cls, results: list[dict[str, float]], parts: tuple[str, ...]) -> ScoreResult:
        """Per-sample component dicts (a detector's scores) -> every component logged, and the score
        the mean of `parts` (a scorer mode's components)."""
        if not results:
            return cls(np.zeros(0))
        components = {k: np.array([r[k] for r in results], dtype=np.float64) for k in results[0]}
        return cls(np.mean([components[k] for k in parts], axis=0), components)


class Scorer(Protocol):
    name: str

    def __call__(self, batch: ScoreBatch) -> ScoreResult: ...


class ScorerError(RuntimeError):
    """A scorer failed or returned a non-finite value; the message names the scorer and sample."""


def run_scorer(scorer: Scorer, batch: ScoreBatch) -> ScoreResult:
    """Call a scorer and check its output: right length, every value finite. Errors name the
    scorer and the first offending sample; a failure is never turned into a silent zero."""
    name = getattr(scorer, "name", type(scorer).__name__)
    try:
        result = scorer(batch)
    except ScorerError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the scorer's name
        raise ScorerError(f"scorer {name!r} failed: {type(exc).__name__}: {exc}") from exc
    arrays = {"": np.asarray(result.scores, dtype=np.float64)}
    arrays.update({k: np.asarray(v, dtype=np.float64) for k, v in result.components.items()})
    for key, arr in arrays.items():
        label = f"scorer {name!r}" + (f" component {key!r}" if key else "")
        if arr.shape != (len(batch),):
            raise ScorerError(f"{label} returned shape {arr.shape} for {len(batch)} samples")
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            i = int(bad[0])
            raise ScorerError(f"{label} returned {arr[i]} for sample {batch.sample_ids[i]!r}")
    return ScoreResult(arrays[""], {k: v for k, v in arrays.items() if k})


def aggregate(
    results: dict[str, ScoreResult], weights: dict[str, float], mode: str = "weighted_sum"
) -> ScoreResult:
    """Combine scorers into one reward. `weighted_sum`: sum_i w_i s_i; `mean`: (1/n) sum_i s_i;
    `min` / `max`: elementwise over scorers (weights ignored except in weighted_sum).
    Components of the result: each scorer's total as `<scorer>` and its own components as
    `<scorer>/<component>`."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r} (allowed: {', '.join(AGGREGATIONS)})")
    if not results:
        raise ValueError("aggregate needs at least one scorer result")
    names = list(results)
    stacked = np.stack([results[n].scores for n in names])
    if mode == "weighted_sum":
        w = np.array([weights.get(n, 1.0) for n in names], dtype=np.float64)[:, None]
        total = (w * stacked).sum(axis=0)
    elif mode == "mean":
        total = stacked.mean(axis=0)
    elif mode == "min":
        total = stacked.min(axis=0)
    else:
        total = stacked.max(axis=0)
    components: dict[str, np.ndarray] = {}
    for n in names:
        components[n] = results[n].scores
        for k, v in results[n].components.items():
            components[f"{n}/{k}"] = v
    return ScoreResult(total, components)

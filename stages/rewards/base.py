"""The scorer interface every reward speaks, the registry that builds scorers by recipe name,
and the aggregation of several scorers into one reward.

A scorer takes a `ScoreBatch` (prompts, decoded text and/or images/video frames, per-sample
metadata) and returns a `ScoreResult`: one finite float per sample plus optional named components.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

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


MODALITIES = ("text", "image", "video", "transcript")


@dataclass(frozen=True)
class ScorerEntry:
    """A registered scorer: its factory, the media it reads of a sample (`None`: whatever the
    remote side reads) and the callable whose signature is its params schema."""

    factory: Callable[..., Scorer]
    reads: tuple[str, ...] | None
    schema: Callable[..., Any] | str  # "module:attr" is imported when params are checked


_REGISTRY: dict[str, ScorerEntry] = {}


def register_scorer(name: str, *, reads: tuple[str, ...] | None, schema: Callable[..., Any] | str | None = None
                    ) -> Callable[[Callable[..., Scorer]], Callable[..., Scorer]]:
    """Class/factory decorator: make a scorer buildable by `name` from a recipe. `reads`: the
    media of a sample it scores ("text", "image", "video"; the prompt and metadata always come
    along); its params are the keyword arguments of `schema` (default: the factory itself)."""
    bad = [m for m in reads or () if m not in MODALITIES]
    if bad:
        raise ValueError(f"scorer {name!r}: unknown modalities {bad} (allowed: {', '.join(MODALITIES)})")

    def wrap(factory: Callable[..., Scorer]) -> Callable[..., Scorer]:
        known = _REGISTRY.get(name)
        if known is not None and known.factory is not factory and known.factory.__qualname__ != factory.__qualname__:
            raise ValueError(f"scorer name {name!r} is registered twice")
        _REGISTRY[name] = ScorerEntry(factory, reads, schema or factory)
        return factory

    return wrap


def scorer_names() -> list[str]:
    _load_builtin_scorers()
    return sorted(_REGISTRY)


def _entry(name: str) -> ScorerEntry:
    _load_builtin_scorers()
    if name not in _REGISTRY:
        raise ValueError(f"unknown scorer {name!r} (allowed: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def build_scorer(name: str, **params: Any) -> Scorer:
    return _entry(name).factory(**params)


def prompt_check(name: str) -> Callable[[str], None] | None:
    """Scorer `name`'s check of a prompt it will be asked to score (raises ValueError), if it has one:
    a prompt it cannot score fails when the requests are written, before any sampling."""
    return getattr(_entry(name).factory, "check_prompt", None)


def scorer_reads(name: str) -> tuple[str, ...] | None:
    """The media scorer `name` reads (None: unknown until it runs, e.g. a remote scorer)."""
    return _entry(name).reads


def check_scorer_params(name: str, params: dict[str, Any]) -> list[str]:
    """Problems of `params` for scorer `name`, as `<param>: message` lines (empty: fine), from its
    schema's signature: unknown names, missing required ones, values of the wrong type."""
    import inspect
    import typing

    from pydantic import ConfigDict, ValidationError, create_model

    schema = _entry(name).schema
    if isinstance(schema, str):
        import importlib

        module, attr = schema.split(":")
        schema = getattr(importlib.import_module(module), attr)
    target = schema.__init__ if inspect.isclass(schema) else schema
    signature = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved is checked as Any
        hints = {}
    fields: dict[str, Any] = {}
    for pname, param in signature.parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is param.empty else param.default
        fields[pname] = (hints.get(pname, Any), default)
    model = create_model(f"{name}_params", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False),
                         **fields)
    try:
        model.model_validate(params)
    except ValidationError as exc:
        out = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                out.append(f"{where}: unknown param of scorer {name!r} (allowed: {', '.join(fields) or 'none'})")
            else:
                out.append(f"{where}: {err['msg']}")
        return out
    return []


def _load_builtin_scorers() -> None:
    # Importing a module registers its scorers; model-based ones import torch lazily on build.
    import importlib
    import pkgutil

    import unirl.stages.rewards as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "server", "client", "wire") and not info.name.startswith("_"):
            importlib.import_module(f"unirl.stages.rewards.{info.name}")


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

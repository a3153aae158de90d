"""The scorer registry (the plumbing layer: docs/architecture.md, "Layers"): what `reward.scorers`
may name, what each reads of a sample and the schema of its params, so that a recipe is checked
without a scorer's code (stages/rewards/ holds the scorers; each module registers its own with
`register_scorer`, re-exported by stages/rewards/base.py). Loading the names imports every scorer
module of stages/rewards/, and those import model libraries only when a scorer is built."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODALITIES = ("text", "image", "video", "transcript")


@dataclass(frozen=True)
class ScorerEntry:
    """A registered scorer: its factory, the media it reads of a sample (`None`: whatever the
    remote side reads) and the callable whose signature is its params schema."""

    factory: Callable[..., Any]
    reads: tuple[str, ...] | None
    schema: Callable[..., Any] | str  # "module:attr" is imported when params are checked


_REGISTRY: dict[str, ScorerEntry] = {}


def register_scorer(name: str, *, reads: tuple[str, ...] | None, schema: Callable[..., Any] | str | None = None
                    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class/factory decorator: make a scorer buildable by `name` from a recipe. `reads`: the
    media of a sample it scores ("text", "image", "video"; the prompt and metadata always come
    along); its params are the keyword arguments of `schema` (default: the factory itself)."""
    bad = [m for m in reads or () if m not in MODALITIES]
    if bad:
        raise ValueError(f"scorer {name!r}: unknown modalities {bad} (allowed: {', '.join(MODALITIES)})")

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
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


def build_scorer(name: str, **params: Any) -> Any:
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
    from pydantic import ConfigDict, ValidationError, create_model  # start-up time: pydantic loads on first use, not when a recipe is read

    schema = _entry(name).schema
    if isinstance(schema, str):
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

    pkg = importlib.import_module("unirl.stages.rewards")  # the scorers' package, above this layer

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "server", "client", "wire") and not info.name.startswith("_"):
            importlib.import_module(f"unirl.stages.rewards.{info.name}")



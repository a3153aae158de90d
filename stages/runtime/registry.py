"""Name -> entry registries for the axes a recipe chooses on: model families, policies,
algorithms, rollout engines, data sources (scorers keep their own in stages/rewards/base.py).

A registry is filled by the modules that define its entries (`@families.register("qwen3")` in
stages/models/qwen3.py): on first use it imports every public module of its own package (not its
subpackages), which holds entries and their helpers only, never test fixtures. Reading a recipe
loads every registry, so these modules import torch and model libraries only where they run a
model (subpackages such as stages/models/modules/ hold what must import them at the top). Code elsewhere asks the registry for
an entry by the recipe's name and never compares names itself.

Entries from outside this repository register the same way from their own modules, named in
the `UNIRL_PLUGINS` environment variable (comma-separated) or in the `unirl.plugins` entry-point
group of an installed package; both are imported on first use of any registry.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar, Union

if TYPE_CHECKING:
    from unirl.stages.algorithms.base import Algorithm
    from unirl.stages.compose import Shape
    from unirl.stages.diffusion.kernels import Kernel
    from unirl.stages.engines import RolloutEngine
    from unirl.stages.models.family import Family
    from unirl.stages.policies import Policy
    from unirl.stages.sources import Source
    from unirl.stages.tools import PythonTool

T = TypeVar("T")

_PLUGINS_LOADED = False


def load_plugins() -> None:
    """Import the modules named in `UNIRL_PLUGINS` and the `unirl.plugins` entry points, once."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    names = [n.strip() for n in os.environ.get("UNIRL_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"UNIRL_PLUGINS names {name!r}, which cannot be imported: {exc}") from exc

    for ep in entry_points(group="unirl.plugins"):
        ep.load()


class Registry(Generic[T]):
    """Entries of one kind (`what`, e.g. "model family"), keyed by name. `package`: the package
    whose modules register the built-in entries."""

    def __init__(self, what: str, package: str, field: str):
        self.what = what
        self.package = package
        self.field = field  # the recipe field that names an entry (for error messages)
        self._entries: dict[str, T] = {}
        self._loaded = False
        # Entries whose registration was refused, with the reason (a tool whose schema cannot be
        # made): validate names them, since they are missing from the registry.
        self.refused: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(entry: T) -> T:
            known = self._entries.get(name)
            if known is not None and known is not entry and _qualname(known) != _qualname(entry):
                raise ValueError(f"{self.what} {name!r} is registered twice ({_qualname(known)}, {_qualname(entry)})")
            self._entries[name] = entry
            return entry

        return wrap

    def load(self) -> None:
        """Import every public module of the package (each registers its entries), and plugins."""
        if self._loaded:
            return
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if not info.name.startswith("_") and not info.ispkg:  # a subpackage holds helpers (e.g. torch modules)
                importlib.import_module(f"{self.package}.{info.name}")
        load_plugins()

    def get(self, name: str) -> T:
        self.load()
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"{self.field}: unknown {self.what} {name!r} (allowed: {', '.join(self.names())})")
        return entry

    def names(self) -> list[str]:
        self.load()
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        self.load()
        for name in sorted(self._entries):
            yield name, self._entries[name]

    def __contains__(self, name: str) -> bool:
        self.load()
        return name in self._entries

    def union(self, attr: str, tag: str) -> Any:
        """The discriminated union (pydantic, on `tag`) of every entry's `attr`: a recipe section
        that is any entry's config."""
        from pydantic import Field  # start-up time: pydantic loads on first use, not when a recipe is read

        members = tuple(getattr(entry, attr) for _, entry in self.items())
        return Annotated[Union[members], Field(discriminator=tag)] if len(members) > 1 else members[0]  # noqa: UP007 - a runtime tuple


def load_object(path: str) -> Any:
    """The object at "package.module:Name" (imported on first use, so a declaration stays light)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _qualname(entry: Any) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


# The registries of the axes a recipe chooses on; their entries' modules import them from here to
# register, and the recipe reads them from here (the plumbing layer: docs/architecture.md, "Layers").
kernels: Registry[Kernel] = Registry("SDE kernel", "unirl.stages.diffusion.kernels", "rollout.sampler.sde_kind")
engines: Registry[type[RolloutEngine]] = Registry("rollout engine", "unirl.stages.engines", "rollout.engine.name")
policies: Registry[type[Policy]] = Registry("policy", "unirl.stages.policies", "rollout.kind")
shapes: Registry[type[Shape]] = Registry("composed run shape", "unirl.stages.compose", "compose.kind")
families: Registry[type[Family]] = Registry("model family", "unirl.stages.models", "model.kind")
sources: Registry[type[Source]] = Registry("prompt source", "unirl.stages.sources", "data.name")
tools: Registry[PythonTool] = Registry("tool", "unirl.stages.tools", "agent.tools[].name")
algorithms: Registry[type[Algorithm]] = Registry("algorithm", "unirl.stages.algorithms", "algorithm.name")

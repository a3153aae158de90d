"""The rollout-engine seam: where samples are generated. An engine is one file here that
registers a `RolloutEngine` subclass with its recipe section (`rollout.engine: {name: ...}`).

    generate(requests, out_dir, iteration, policy_version) -> manifest of committed rollout shards
    load_weights(weights_rel, version)                    after an update, for engines with their own weights
    publish_for(trainer, version)                         engines with their own weights: what they load for `version`
    sync(trainer, version)                                publish `version` through the trainer and load it
    release() / resume()                                  colocated layout: free the engine's memory around train
    version                                               the policy version the engine samples with

Tasks and flows talk to an engine only through this protocol, so dedicated servers and
asynchronous producers plug in without touching them. Every row an engine writes records the
weights version that produced it (`policy_version`, as the engine reports it) and its behaviour
log-probs. Engines: `trainside` (the worker group itself), `engine_server` (unirl's own engine
process, stages/engine_server/), `sglang` (a running SGLang server), both clients of one HTTP API
(stages/engines/client.py), and `vllm` (a vLLM server from its own venv, stages/engines/vllm.py);
docs/engines.md.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import engines


def in_group() -> type[RolloutEngine]:
    """The engine that samples in the training worker group with the trained weights themselves
    (the one engine that holds no weights of its own): where held-out evaluation samples while a
    dedicated engine belongs to an async run's producer."""
    (engine,) = [cls for _, cls in engines.items() if not cls.own_weights]
    return engine


class RolloutEngine(ABC):
    name: ClassVar[str]
    config: ClassVar[type[Section]]
    # True when the engine holds its own copy of the weights, which the sync task must update.
    own_weights: ClassVar[bool] = False
    # The behaviour tolerance of rows it samples with the trained weights (None: the policy's
    # measured default; an engine with other kernels or precision declares its own).
    behaviour_tolerance: ClassVar[float | None] = None

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe using this engine; ValueError('field.path: ...')."""

    @abstractmethod
    def __init__(self, recipe: Any, storage: Any, group: Any):
        """The run's engine: its recipe, run storage and worker group (tasks/common.py `engine_of`)."""

    @property
    def version(self) -> int | None:
        raise NotImplementedError

    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "") -> dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    def load_weights(self, weights_rel: str, version: int) -> dict[str, Any] | None:
        """Load published weights `version` (at `weights_rel`); what the engine reports of them, if anything."""

    def publish_for(self, trainer: Any, version: int) -> str:
        """Engines with their own weights: the folder they load for `version`, published through `trainer`."""
        raise NotImplementedError

    def sync(self, trainer: Any, version: int) -> dict[str, Any]:
        """Make the engine sample with policy `version`, which `trainer` (the worker group) holds:
        what it published and loaded (files, seconds)."""
        return {}

    def connect(self) -> None:
        """Reach the engine now (before anything heavy starts): an engine at a configured URL that
        does not answer is an error naming the URL."""

    def release(self) -> None:
        """Colocated layout: free the engine's memory before the trainer trains."""

    def resume(self) -> None:
        """Colocated layout: take the memory back after the sync."""

    def close(self) -> None:
        """Stop what the engine started (its server process)."""

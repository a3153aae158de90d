"""`trainside`: rollouts are sampled inside the training worker group with the training weights
themselves, so there is nothing to sync and the behaviour policy is the trainer's (the on-policy
check compares the trainer's replay with the sampler's record)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.engines import RolloutEngine
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import engines


class TrainsideConfig(Section):
    """Generate inside the training worker group (no separate engine, no weight sync)."""

    name: Literal["trainside"] = Field("trainside", description="Rollout engine.")


@engines.register("trainside")
class Trainside(RolloutEngine):
    name = "trainside"
    config = TrainsideConfig
    own_weights = False

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.rollout.mode == "async":
            raise ValueError("rollout.mode: async samples on a dedicated engine while the worker group trains; set "
                             "rollout.engine.name to engine_server or sglang (docs/engines.md), or rollout.mode: sync")

    def __init__(self, recipe: Any, storage: Any, group: Any):
        self.group = group

    @property
    def version(self) -> int | None:
        return self.group.version

    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "") -> dict[str, Any]:
        self.group.ensure(policy_version)
        return self.group.call("generate", iteration=iteration, requests=requests, out_dir=out_dir,
                               greedy=greedy, seed_tag=seed_tag)

    def load_weights(self, weights_rel: str, version: int) -> None:
        self.group.ensure(version)

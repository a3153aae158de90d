"""DanceGRPO (Xue et al. 2025): Flow-GRPO's clipped objective with a constant-noise SDE step
(`sde_kind: dance`, std = eta) instead of Flow-GRPO's sigma-scaled one."""
from __future__ import annotations

from typing import Any, Literal

from unirl.stages.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.stages.runtime.registry import algorithms


class DanceGRPOConfig(FlowGRPOConfig):
    """DanceGRPO: samples with the `dance` kernel (rollout.sampler.sde_kind)."""

    name: Literal["dancegrpo"] = "dancegrpo"  # type: ignore[assignment]


@algorithms.register("dancegrpo")
class DanceGRPO(FlowGRPO):
    name = "dancegrpo"
    config = DanceGRPOConfig

    @classmethod
    def sampler_defaults(cls) -> dict[str, Any]:
        return {"sde_kind": "dance"}

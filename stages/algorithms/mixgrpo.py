"""MixGRPO (Li et al. 2025): Flow-GRPO on a sliding window of SDE steps (the rest are ODE steps),
which moves by `stride` every `shift_every` iterations (`rollout.sampler.sde_steps.mode: mixgrpo`)."""
from __future__ import annotations

from typing import Any, Literal

from unirl.stages.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.stages.runtime.registry import algorithms


class MixGRPOConfig(FlowGRPOConfig):
    """MixGRPO: SDE steps from a sliding window (rollout.sampler.sde_steps.mode: mixgrpo)."""

    name: Literal["mixgrpo"] = "mixgrpo"  # type: ignore[assignment]


@algorithms.register("mixgrpo")
class MixGRPO(FlowGRPO):
    name = "mixgrpo"
    config = MixGRPOConfig

    @classmethod
    def sampler_defaults(cls) -> dict[str, Any]:
        return {"sde_steps.mode": "mixgrpo"}

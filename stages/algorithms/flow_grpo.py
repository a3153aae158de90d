"""Flow-GRPO (Liu et al. 2025): PPO's clipped surrogate on the per-step log-probs of the SDE
sampler of a flow-matching model, plus the closed-form KL between two Gaussian steps.
DanceGRPO and MixGRPO use this loss too; they differ in the kernel and the SDE steps chosen.

Symbols: S = SDE steps trained per sample; r = p_theta(x_{t-1} | x_t) / p_old(x_{t-1} | x_t) per
step; A = advantage of the sample, clipped to [-adv_clip, adv_clip]; eps = clip_range.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.algorithms.flow_likelihood import FlowLikelihood
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


class FlowGRPOConfig(Section):
    """Flow-GRPO (Liu et al. 2025): the clipped ratio objective on the SDE steps' log-probs."""

    name: Literal["flow_grpo"] = "flow_grpo"
    clip_range: float = Field(1e-4, gt=0, description="Ratio clip epsilon.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of flow_kl to the reference (adapter disabled, or the initial weights).")


@algorithms.register("flow_grpo")
class FlowGRPO(FlowLikelihood):
    name = "flow_grpo"
    config = FlowGRPOConfig

    @property
    def kl_coef(self) -> float:
        return self.cfg.kl_coef

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any, weights: Any) -> Any:
        from unirl.stages.kernels.flow_losses import flow_grpo_loss  # start-up time: torch loads at the first train step

        return flow_grpo_loss(logp, old, adv, clip_range=self.cfg.clip_range, adv_clip=self.cfg.adv_clip, weights=weights)

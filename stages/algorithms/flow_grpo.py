"""Flow-GRPO (Liu et al. 2025): PPO's clipped surrogate on the per-step log-probs of the SDE
sampler of a flow-matching model, plus the closed-form KL between two Gaussian steps.
DanceGRPO and MixGRPO use this loss too; they differ in the kernel and the SDE steps chosen.

Symbols: S = SDE steps trained per sample; r = p_theta(x_{t-1} | x_t) / p_old(x_{t-1} | x_t) per
step; A = advantage of the sample, clipped to [-adv_clip, adv_clip]; eps = clip_range.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput, loss_metrics
from unirl.stages.algorithms.base import algorithms
from unirl.stages.algorithms.flow_likelihood import FlowLikelihood
from unirl.stages.runtime.config_base import Section


def step_advantages(adv: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """adv (B,) or (B, S) -> detached float32 (B, S) shaped like `like`."""
    if adv.shape not in (like.shape[:1], like.shape):
        raise ValueError(f"{name}: adv must be (B,) or (B, S) = {tuple(like.shape)}, got {tuple(adv.shape)}")
    a = adv.detach().to(torch.float32)
    return a[:, None].expand_as(like) if a.dim() == 1 else a


def check_step_logps(logp: torch.Tensor, old_logp: torch.Tensor, name: str) -> None:
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be (B, S), one log-prob per trained step, got {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(f"{name}: old_logp has shape {tuple(old_logp.shape)}, logp has {tuple(logp.shape)}")


def flow_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip: float = 5.0,
) -> LossOutput:
    """logp, old_logp: (B, S); adv: (B,) per sample (or (B, S)).

    A = clip(adv, -adv_clip, adv_clip); r = exp(logp - old_logp);
    loss = mean over (B, S) of max(-A*r, -A*clip(r, 1-eps, 1+eps)).
    Metrics: clip_frac(_low/_high), approx_kl = mean((logp-old)^2)/2, ratio_mean/min/max.
    """
    check_step_logps(logp, old_logp, "flow_grpo_loss")
    if not 0 <= clip_range < 1 or adv_clip <= 0:
        raise ValueError(f"flow_grpo_loss: need 0 <= clip_range < 1 and adv_clip > 0, got {clip_range}, {adv_clip}")
    log_ratio = logp.to(torch.float32) - old_logp.detach().to(torch.float32)
    a = step_advantages(adv, log_ratio, "flow_grpo_loss").clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(-a * ratio, -a * clipped).mean()
    ones = torch.ones_like(ratio)
    metrics = loss_metrics(
        log_ratio, ones, ratio, ones,
        clipped_low=(ratio < 1 - clip_range) & (a < 0),
        clipped_high=(ratio > 1 + clip_range) & (a > 0),
    )
    return LossOutput(loss, metrics)


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

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any) -> LossOutput:
        return flow_grpo_loss(logp, old, adv, clip_range=self.cfg.clip_range, adv_clip=self.cfg.adv_clip)

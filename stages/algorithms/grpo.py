"""The clipped token-level policy-gradient loss of GRPO (DeepSeekMath, Shao et al. 2024, eq. 3),
PPO's surrogate with group-relative advantages. clip_low != clip_high is DAPO's clip-higher
(Yu et al. 2025); agg="seq_mean_token_sum_norm" with a fixed horizon is Dr.GRPO (Liu et al. 2025).

Symbols: r = pi_theta / pi_old per token, A = advantage, eps_low/eps_high = clip_low/clip_high.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput, aggregate, loss_metrics, prepare
from unirl.stages.algorithms.base import algorithms
from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token_mean",
    horizon: float | None = None,
) -> LossOutput:
    """logp, old_logp, mask: (B, L); adv: (B,) per sequence or (B, L) per token.

    r = exp(logp - old_logp); l = -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), reduced by agg.
    Clipping is active where r > 1+clip_high with A > 0 (clip_frac_high) or r < 1-clip_low with
    A < 0 (clip_frac_low); there the token's gradient is zero.
    """
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"grpo_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    log_ratio, _, a, m = prepare(logp, old_logp, adv, mask, name="grpo_loss")
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * a, clipped * a)
    loss = aggregate(per_token, m, agg, horizon)
    metrics = loss_metrics(
        log_ratio, m, ratio, m,
        clipped_low=(ratio < 1 - clip_low) & (a < 0),
        clipped_high=(ratio > 1 + clip_high) & (a > 0),
    )
    return LossOutput(loss, metrics)


class GRPOConfig(Section):
    """GRPO (DeepSeekMath) with DAPO's clip-higher; Dr.GRPO is `agg: seq_mean_token_sum_norm`."""

    name: Literal["grpo"] = "grpo"
    clip_low: float = Field(0.2, ge=0, lt=1, description="Lower clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="Upper clip: ratio <= 1 + clip_high.")
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="Loss aggregation over tokens and sequences."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the frozen initial policy (0: no reference model).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")


@algorithms.register("grpo")
class GRPO(TokenPolicyGradient):
    name = "grpo"
    distills = True  # takes a per-token advantage
    config = GRPOConfig

    def loss(self, logp, old_logp, adv, mask, horizon):
        c = self.cfg
        return grpo_loss(logp, old_logp, adv, mask, clip_low=c.clip_low, clip_high=c.clip_high, agg=c.agg, horizon=horizon)

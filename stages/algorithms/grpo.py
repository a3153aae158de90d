"""The clipped token-level policy-gradient loss of GRPO (DeepSeekMath, Shao et al. 2024, eq. 3),
PPO's surrogate with group-relative advantages. clip_low != clip_high is DAPO's clip-higher
(Yu et al. 2025); agg="seq_mean_token_sum_norm" with a fixed horizon is Dr.GRPO (Liu et al. 2025).

Symbols: r = pi_theta / pi_old per token, A = advantage, eps_low/eps_high = clip_low/clip_high.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


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
        from unirl.stages.kernels.token_losses import grpo_loss  # start-up time: torch loads at the first train step

        c = self.cfg
        return grpo_loss(logp, old_logp, adv, mask, clip_low=c.clip_low, clip_high=c.clip_high, agg=c.agg, horizon=horizon)

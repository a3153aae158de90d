"""Divergence Regularized Policy Optimization (DRPO; Yao, Zhou, Qi et al., "Rethinking the
Divergence Regularization in LLM RL"). Instead of clipping the ratio, an advantage-weighted
quadratic penalty on the policy shift keeps updates inside the trust region smoothly:

  l = -A*r + |A| * w * (r - 1)^2 / (2*epsilon),   r = pi_theta/mu,   w = mu(y_t) or 1

mu is the behaviour policy (old_logp). With mu_weighted the penalty measures the absolute
probability shift mu*(r-1) of the sampled token (DPPO's trust-region geometry), so rare tokens
are not over-penalised. The log-ratio is clamped to [-20, 20] to keep exp finite.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


class DRPOConfig(Section):
    """DRPO: ratio objective with a divergence penalty |A| w (r-1)^2 / (2 epsilon) instead of clipping."""

    name: Literal["drpo"] = "drpo"
    epsilon: float = Field(12.5, gt=0, description="Penalty temperature epsilon.")
    mu_weighted: bool = Field(True, description="Weight the penalty by the old token probability.")
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field("token_mean", description="Loss aggregation.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")


@algorithms.register("drpo")
class DRPO(TokenPolicyGradient):
    name = "drpo"
    distills = True  # takes a per-token advantage
    config = DRPOConfig

    def loss(self, logp, old_logp, adv, mask, horizon):
        from unirl.stages.kernels.token_losses import drpo_loss  # start-up time: torch loads at the first train step

        c = self.cfg
        return drpo_loss(logp, old_logp, adv, mask, epsilon=c.epsilon, mu_weighted=c.mu_weighted, agg=c.agg, horizon=horizon)

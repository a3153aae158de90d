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

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput, aggregate, loss_metrics, prepare
from unirl.stages.algorithms.base import algorithms
from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section

LOG_RATIO_LIMIT = 20.0


def drpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 12.5,
    mu_weighted: bool = True,
    agg: str = "token_mean",
    horizon: float | None = None,
) -> LossOutput:
    """logp, old_logp, mask: (B, L); adv: (B,) or (B, L).

    d = clamp(logp-old_logp, -20, 20); r = exp(d); w = exp(old_logp) if mu_weighted else 1;
    l = -A*r + |A|*w*(r-1)^2/(2*epsilon), reduced by agg (as in grpo_loss).
    DRPO has no ratio clip: clip_frac_low/high report where d hit -20/+20.
    """
    if epsilon <= 0:
        raise ValueError(f"drpo_loss: epsilon must be > 0, got {epsilon}")
    log_ratio, old, a, m = prepare(logp, old_logp, adv, mask, name="drpo_loss")
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    w = torch.exp(old) if mu_weighted else torch.ones_like(old)
    per_token = -a * ratio + a.abs() * w * (ratio - 1).square() / (2 * epsilon)
    loss = aggregate(per_token, m, agg, horizon)
    metrics = loss_metrics(
        log_ratio, m, ratio, m,
        clipped_low=log_ratio < -LOG_RATIO_LIMIT,
        clipped_high=log_ratio > LOG_RATIO_LIMIT,
    )
    return LossOutput(loss, metrics)


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
        c = self.cfg
        return drpo_loss(logp, old_logp, adv, mask, epsilon=c.epsilon, mu_weighted=c.mu_weighted, agg=c.agg, horizon=horizon)

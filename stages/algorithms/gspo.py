"""Group Sequence Policy Optimization (GSPO, Zheng et al. 2025, eq. 5-7): the clipped surrogate
of GRPO applied once per sequence, to the length-normalised sequence likelihood ratio
s = (pi_theta(y|x) / pi_old(y|x))^(1/|y|) = exp(mean_t(logp - old_logp)).
s is a differentiable function of logp, so the gradient reaches every token of the sequence
equally weighted by s*A. The clip range is tiny (3e-4 / 4e-4) because s averages out token noise.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput, loss_metrics, prepare
from unirl.stages.algorithms.base import algorithms
from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> LossOutput:
    """logp, old_logp, mask: (B, L); adv: (B,).

    s = exp(sum_t((logp-old_logp)*m) / sum_t(m)); l_b = -min(s*A, clip(s, 1-clip_low, 1+clip_high)*A);
    loss = mean over sequences with at least one token. Ratio and clip metrics are per sequence.
    """
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"gspo_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    log_ratio, _, a, m = prepare(logp, old_logp, adv, mask, name="gspo_loss", token_adv=False)
    length = m.sum(-1)
    has = (length > 0).to(torch.float32)
    seq_ratio = torch.exp((log_ratio * m).sum(-1) / torch.where(length > 0, length, torch.ones_like(length)))
    clipped = seq_ratio.clamp(1 - clip_low, 1 + clip_high)
    per_seq = -torch.minimum(seq_ratio * a, clipped * a)
    loss = (per_seq * has).sum() / has.sum()
    metrics = loss_metrics(
        log_ratio, m, seq_ratio, has,
        clipped_low=(seq_ratio < 1 - clip_low) & (a < 0),
        clipped_high=(seq_ratio > 1 + clip_high) & (a > 0),
    )
    return LossOutput(loss, metrics)


class GSPOConfig(Section):
    """GSPO (Zheng et al. 2025): the clipped objective on the length-normalized sequence ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1, description="Lower clip of the sequence ratio.")
    clip_high: float = Field(4e-4, ge=0, description="Upper clip of the sequence ratio.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")


@algorithms.register("gspo")
class GSPO(TokenPolicyGradient):
    name = "gspo"
    config = GSPOConfig
    correction_levels = ("sequence",)  # one ratio per sequence: a token-level weight has nowhere to go

    @property
    def sequence_level(self) -> bool:
        return True

    def loss(self, logp, old_logp, adv, mask, horizon):
        return gspo_loss(logp, old_logp, adv, mask, clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high)

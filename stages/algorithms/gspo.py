"""Group Sequence Policy Optimization (GSPO, Zheng et al. 2025, eq. 5-7): the clipped surrogate
of GRPO applied once per sequence, to the length-normalised sequence likelihood ratio
s = (pi_theta(y|x) / pi_old(y|x))^(1/|y|) = exp(mean_t(logp - old_logp)).
s is a differentiable function of logp, so the gradient reaches every token of the sequence
equally weighted by s*A. The clip range is tiny (3e-4 / 4e-4) because s averages out token noise.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from unirl.stages.algorithms.policy_gradient import TokenPolicyGradient
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


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
        from unirl.stages.kernels.token_losses import gspo_loss  # start-up time: torch loads at the first train step

        return gspo_loss(logp, old_logp, adv, mask, clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high)

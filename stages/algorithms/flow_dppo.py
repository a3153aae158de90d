"""Flow-DPPO: a trust region for flow-matching policies that drops steps instead of clipping ratios.

A step is dropped (zero loss, zero gradient) when the policy has already moved away from the
behaviour policy in the direction the advantage pushes it, measured by the closed-form KL of the
two Gaussian transitions rather than by the noisy log-prob ratio.

Symbols: S = SDE steps trained per sample; r = exp(logp - old_logp); A = advantage;
k = KL(N(mean, std^2) || N(old_mean, std^2)) per step; delta = threshold.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.algorithms.flow_likelihood import FlowLikelihood
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


class FlowDPPOConfig(Section):
    """Flow-DPPO: drop updates whose per-step KL passes a threshold in the ratio's direction."""

    name: Literal["flow_dppo"] = "flow_dppo"
    threshold: float = Field(1e-5, gt=0, description="Per-step KL threshold.")


@algorithms.register("flow_dppo")
class FlowDPPO(FlowLikelihood):
    name = "flow_dppo"
    config = FlowDPPOConfig

    reads_old_means = True

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any, weights: Any) -> Any:
        from unirl.stages.kernels.flow_losses import flow_dppo_loss  # start-up time: torch loads at the first train step

        old_mean = out.mean.detach() if old_mean is None else old_mean
        return flow_dppo_loss(logp, old, adv, out.mean[:, None], old_mean[:, None], out.std[:, None],
                              threshold=self.cfg.threshold, weights=weights)

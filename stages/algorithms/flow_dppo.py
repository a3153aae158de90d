"""Flow-DPPO: a trust region for flow-matching policies that drops steps instead of clipping ratios.

A step is dropped (zero loss, zero gradient) when the policy has already moved away from the
behaviour policy in the direction the advantage pushes it, measured by the closed-form KL of the
two Gaussian transitions rather than by the noisy log-prob ratio.

Symbols: S = SDE steps trained per sample; r = exp(logp - old_logp); A = advantage;
k = KL(N(mean, std^2) || N(old_mean, std^2)) per step; delta = threshold.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput, loss_metrics
from unirl.stages.algorithms.base import TrainContext, algorithms
from unirl.stages.algorithms.flow_grpo import check_step_logps, step_advantages
from unirl.stages.algorithms.flow_likelihood import FlowLikelihood, transition_means
from unirl.stages.runtime.config_base import Section


def flow_dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: float | torch.Tensor,
    *,
    threshold: float = 1e-5,
) -> LossOutput:
    """logp, old_logp: (B, S); adv: (B,) (or (B, S)); mean, old_mean: (B, S, ...) transition means;
    std: transition standard deviation, a float or a tensor aligned with the leading dims, e.g. (B, S).

    r = exp(logp - old_logp); k (B, S) = mean over the dims after S of (mean - old_mean)^2 / (2*std^2);
    drop = k >= threshold and ((r > 1 and A > 0) or (r < 1 and A < 0));
    loss = mean over (B, S) of where(drop, 0, -A*r).
    Metrics: drop_frac; clip_frac(_low/_high) are the dropped fractions with A < 0 / A > 0;
    approx_kl, ratio_mean/min/max.
    """
    name = "flow_dppo_loss"
    check_step_logps(logp, old_logp, name)
    if mean.dim() < 2 or mean.shape[:2] != logp.shape:
        raise ValueError(f"{name}: mean must be (B, S, ...) with (B, S) = {tuple(logp.shape)}, got {tuple(mean.shape)}")
    if old_mean.shape != mean.shape:
        raise ValueError(f"{name}: old_mean has shape {tuple(old_mean.shape)}, mean has {tuple(mean.shape)}")
    log_ratio = logp.to(torch.float32) - old_logp.detach().to(torch.float32)
    a = step_advantages(adv, log_ratio, name)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        s = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
        s = s.reshape(*s.shape, *([1] * (mean.dim() - s.dim())))
        per_element = (mean.to(torch.float32) - old_mean.to(torch.float32)).square() / (2 * s.square())
        k = per_element.mean(dim=tuple(range(2, mean.dim()))) if mean.dim() > 2 else per_element
        pushed_up = (ratio > 1) & (a > 0)
        pushed_down = (ratio < 1) & (a < 0)
        drop = (k >= threshold) & (pushed_up | pushed_down)
    loss = torch.where(drop, torch.zeros_like(ratio), -a * ratio).mean()
    ones = torch.ones_like(ratio)
    metrics = loss_metrics(
        log_ratio, ones, ratio, ones,
        clipped_low=drop & pushed_down,
        clipped_high=drop & pushed_up,
    )
    metrics["drop_frac"] = drop.float().mean().item()
    return LossOutput(loss, metrics)


class FlowDPPOConfig(Section):
    """Flow-DPPO: drop updates whose per-step KL passes a threshold in the ratio's direction."""

    name: Literal["flow_dppo"] = "flow_dppo"
    threshold: float = Field(1e-5, gt=0, description="Per-step KL threshold.")


@algorithms.register("flow_dppo")
class FlowDPPO(FlowLikelihood):
    name = "flow_dppo"
    config = FlowDPPOConfig

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        """The old policy's transition means of the later mini-batches, before any step (the first
        mini-batch's are the live ones, detached)."""
        return transition_means(ctx, batch) if update > 0 else None

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any) -> LossOutput:
        old_mean = out.mean.detach() if old_mean is None else old_mean
        return flow_dppo_loss(logp, old, adv, out.mean[:, None], old_mean[:, None], out.std[:, None],
                              threshold=self.cfg.threshold)

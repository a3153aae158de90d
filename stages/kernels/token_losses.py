"""The token-level policy losses (docs/architecture.md, "The math contract"): GRPO's clipped
surrogate with DAPO's clip-higher, DRPO's, GSPO's sequence-level ratio. Each is positively
homogeneous in the advantage (l(w*A) = w*l(A), w >= 0), which the off-policy correction relies on."""
from __future__ import annotations

import torch

from unirl.stages.kernels.aggregate import LossOutput, aggregate, loss_metrics, prepare


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

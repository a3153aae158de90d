"""What every token-level policy loss shares: the output type, the input checks, the metrics, and
the three ways to reduce per-token losses l (B, L) under a mask m (B, L) to one scalar:

  token_mean               sum(l*m) / sum(m)                every token weighs the same (DAPO)
  seq_mean_token_mean      mean_b(sum_t(l*m) / sum_t(m))    every sequence weighs the same (GRPO)
  seq_mean_token_sum_norm  mean_b(sum_t(l*m) / horizon)     a constant divisor, no length bias (Dr.GRPO)

In seq_mean_token_mean a row without any masked token has no mean and is left out of mean_b;
in seq_mean_token_sum_norm it counts, with loss 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
METRIC_KEYS = (
    "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "ratio_max", "ratio_min",
)


@dataclass(frozen=True)
class LossOutput:
    """loss: scalar float32 tensor to backpropagate; metrics: plain floats (logged as `train/<key>`)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def prepare(logp, old_logp, adv, mask, *, name: str, token_adv: bool = True):
    """Check shapes and cast to float32.

    logp, old_logp, mask: (B, L); adv: (B,), or (B, L) when token_adv.
    Returns (log_ratio (B, L), old_logp (B, L), adv, mask (B, L)), where adv is (B, L) when
    token_adv and (B,) otherwise. log_ratio and old_logp are 0 at padding, so padding that holds
    -inf or nan (common for unscored positions) cannot leak into the loss or its gradient.
    old_logp is detached: it belongs to the behaviour policy.
    """
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be (B, L), got shape {tuple(logp.shape)}")
    for label, t in (("old_logp", old_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name}: {label} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    shapes = [logp.shape[:1]] + ([logp.shape] if token_adv else [])
    if adv.shape not in shapes:
        wanted = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{name}: adv must have shape {wanted}, got {tuple(adv.shape)}")
    m = mask.to(torch.float32)
    if not bool((m > 0).any()):
        raise ValueError(f"{name}: mask selects no token, so there is nothing to train on")
    on = m > 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    log_ratio = torch.where(on, logp.to(torch.float32) - old_logp.detach().to(torch.float32), zero)
    old = torch.where(on, old_logp.detach().to(torch.float32), zero)
    a = adv.detach().to(torch.float32)
    if token_adv:
        a = torch.where(on, a if a.dim() == 2 else a[:, None].expand_as(m), zero)
    return log_ratio, old, a, m


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str, horizon: float | None = None) -> torch.Tensor:
    """loss, mask: (B, L) float32 -> scalar, by one of AGG_MODES (see the module docstring)."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    seq_sum = (loss * mask).sum(-1)
    if agg == "token_mean":
        return seq_sum.sum() / mask.sum()
    if agg == "seq_mean_token_mean":
        return seq_mean(seq_sum, mask.sum(-1))
    horizon = loss.shape[-1] if horizon is None else horizon
    if horizon <= 0:
        raise ValueError(f"horizon must be a positive token count, got {horizon}")
    return (seq_sum / horizon).mean()


def seq_mean(seq_sum: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """mean_b(seq_sum / seq_len) over the rows with seq_len > 0; both (B,)."""
    has = seq_len > 0
    per_seq = seq_sum / torch.where(has, seq_len, torch.ones_like(seq_len))
    return (per_seq * has).sum() / has.sum()


@torch.no_grad()
def loss_metrics(log_ratio, mask, ratio, weight, clipped_low, clipped_high) -> dict[str, float]:
    """The metrics every loss reports, read back in one device sync.

    log_ratio, mask: (B, L) for approx_kl = masked mean of (logp - old)^2 / 2.
    ratio, weight, clipped_low, clipped_high share one shape: per token (B, L) with weight = mask,
    or per sequence (B,) with weight 1 for rows holding a token. Clip fractions and ratio
    statistics are over the entries with weight > 0.
    """
    on = weight > 0
    total = weight.sum()
    low = (clipped_low * weight).sum() / total
    high = (clipped_high * weight).sum() / total
    values = torch.stack([
        low + high,
        low,
        high,
        (log_ratio.square() / 2 * mask).sum() / mask.sum(),
        (ratio * weight).sum() / total,
        torch.where(on, ratio, -torch.inf).max(),
        torch.where(on, ratio, torch.inf).min(),
    ])
    return dict(zip(METRIC_KEYS, values.tolist()))

"""The behaviour check's arithmetic (stages/algorithms/base.py describes its three levels): the
trainer's replay against the log-probs recorded at sampling time, and an advantage with what the
check masked taken out."""
from __future__ import annotations

from typing import Any

import torch

from unirl.stages.kernels.errors import mismatch_error


def behaviour_mismatch(replayed: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |replayed - recorded| over the mask: the behaviour-vs-trainer mismatch, measured
    without judging it (rows of older policy versions are expected to differ)."""
    diff = torch.where(mask > 0, (replayed.detach().float() - recorded.float()).abs(), torch.zeros_like(mask))
    return float(diff.max()) if diff.numel() else 0.0, float(diff.sum()) / max(float(mask.sum()), 1.0)


def check_behaviour(replayed: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor | None, *, ctx: Any,
                    sample_ids: list[str], what: str, maskable: bool = True) -> tuple[float, float, torch.Tensor]:
    """Compare the trainer's replay with the sampler's record, replayed/recorded (B, ...), mask
    (B, ...) or None (every element). Returns (max, mean |difference| over the mask, keep): keep
    (B, ...) is 0 where an element is masked out of the loss (its difference above `ctx.tolerance`,
    at most `ctx.mask_limit`), 1 elsewhere. Raises BehaviourMismatchError naming the worst sample
    above the mask limit (above the tolerance when not `maskable`, or without a mask band)."""
    diff = (replayed.detach().float() - recorded.float()).abs()
    if mask is not None:
        diff = torch.where(mask > 0, diff, torch.zeros_like(diff))
    per_sample = diff.reshape(diff.shape[0], -1).max(dim=1).values
    worst = int(per_sample.argmax()) if per_sample.numel() else 0
    largest = float(per_sample.max()) if per_sample.numel() else 0.0
    limit = max(ctx.mask_limit, ctx.tolerance) if maskable and ctx.mask_limit is not None else ctx.tolerance
    if not largest <= limit:  # also catches nan
        raise mismatch_error(ctx, sample_ids[worst], what, largest, limit)
    checked = per_sample.new_ones(per_sample.shape, dtype=torch.bool) if mask is None else \
        (mask.reshape(mask.shape[0], -1) > 0).any(dim=1)
    ctx.checked.update(s for s, c in zip(sample_ids, checked.tolist()) if c)
    for i in torch.nonzero(per_sample > ctx.tolerance).flatten().tolist():
        ctx.masked[sample_ids[i]] = max(ctx.masked.get(sample_ids[i], 0.0), float(per_sample[i]))
    keep = (diff <= ctx.tolerance).to(replayed.dtype)
    count = float(mask.sum()) if mask is not None else float(diff.numel())
    return largest, float(diff.sum()) / max(count, 1.0), keep


def masked_advantage(adv: torch.Tensor, keep: torch.Tensor, *, token_level: bool) -> torch.Tensor:
    """adv (B,) or (B, L) with the elements where keep (B, L) is 0 set to 0: per token, or, not
    `token_level`, for the whole row (B,) of any such token."""
    if not token_level:
        row = keep.amin(dim=-1)
        return adv * (row[:, None] if adv.dim() == 2 else row)
    return (adv[:, None] if adv.dim() == 1 else adv) * keep

"""Group-relative advantages for GRPO-style training (DeepSeekMath, Shao et al. 2024, eq. 3).

Every prompt is sampled G times; the G rewards form a group and each sample's advantage is its
reward relative to the group: A = (r - mean_group) / (std + eps), with the population std (ddof=0).
Variants (docs/architecture.md, "The math contract"):
  use_global_std=True   divide by the std of the whole batch instead of the group's
                        (keeps small within-group differences from being blown up).
  scope="global"        the whole batch is one group: mean and std over the batch.
  normalize=False       mean subtraction only (Dr.GRPO, Liu et al. 2025, drops the std division).
A group whose rewards are all equal carries no learning signal and gets exactly 0.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

SCOPES = ("group", "global")


def _check(rewards, group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return rewards as float64 (N,), each sample's group index (N,), and the number of groups."""
    r = torch.as_tensor(rewards, dtype=torch.float64).detach().cpu()
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {tuple(r.shape)}")
    if r.numel() == 0:
        raise ValueError("rewards is empty: there are no samples to compute advantages for")
    if len(group_ids) != r.numel():
        raise ValueError(
            f"rewards has {r.numel()} entries but group_ids has {len(group_ids)}; "
            "pass one group id per sample"
        )
    bad = (~torch.isfinite(r)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"reward at index {i} (group {group_ids[i]!r}) is {r[i].item()}; "
            "every reward must be a finite float, check the scorer"
        )
    index_of: dict[Hashable, int] = {}
    index = torch.tensor([index_of.setdefault(g, len(index_of)) for g in group_ids])
    return r, index, len(index_of)


def _group_moments(r: torch.Tensor, index: torch.Tensor, num_groups: int):
    """Per-group mean, population std and an all-equal flag, each (num_groups,)."""
    count = torch.bincount(index, minlength=num_groups).to(r.dtype)
    mean = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, index, r) / count
    var = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, index, (r - mean[index]) ** 2) / count
    lo = torch.full((num_groups,), torch.inf, dtype=r.dtype).scatter_reduce_(0, index, r, "amin")
    hi = torch.full((num_groups,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, index, r, "amax")
    return mean, var.sqrt(), lo == hi


def group_advantages(
    rewards,
    group_ids: Sequence[Hashable],
    *,
    scope: str = "group",
    normalize: bool = True,
    use_global_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """rewards: (N,) floats; group_ids: N hashable ids (samples of one prompt share an id).

    Returns A: (N,) float32 on the CPU. Statistics are computed in float64 so that a group of
    equal rewards is detected exactly, whatever its size.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    r, index, num_groups = _check(rewards, group_ids)
    if scope == "global":
        index, num_groups = torch.zeros_like(index), 1
    mean, std, flat = _group_moments(r, index, num_groups)
    adv = r - mean[index]
    if normalize:
        scale = r.std(correction=0) if use_global_std else std[index]
        adv = adv / (scale + eps)
    adv = torch.where(flat[index], torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def group_stats(rewards, group_ids: Sequence[Hashable]) -> dict[str, float]:
    """Per-batch summary for logging (the caller namespaces the keys, e.g. `rollout/...`).

    zero_std_group_frac: fraction of groups whose rewards are all equal (no gradient signal);
    num_groups; reward_mean, reward_std: over the batch; group_std_mean: mean within-group std.
    """
    r, index, num_groups = _check(rewards, group_ids)
    _, std, flat = _group_moments(r, index, num_groups)
    return {
        "zero_std_group_frac": flat.double().mean().item(),
        "num_groups": float(num_groups),
        "reward_mean": r.mean().item(),
        "reward_std": r.std(correction=0).item(),
        "group_std_mean": std.mean().item(),
    }

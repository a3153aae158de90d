"""Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
Divergence", 2020). With x = ref_logp - logp = log(ref/pi):
  k1 = -x               unbiased, high variance, can be negative
  k2 = x^2 / 2          biased, low variance, >= 0
  k3 = exp(x) - x - 1   unbiased, low variance, >= 0 (the KL penalty of GRPO, DeepSeekMath eq. 4)
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """logp, ref_logp: same shape, e.g. (B, L) -> float32 tensor of that shape (unreduced, unmasked)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl: logp has shape {tuple(logp.shape)}, ref_logp has {tuple(ref_logp.shape)}")
    x = ref_logp.to(torch.float32) - logp.to(torch.float32)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x.square() / 2
    return torch.exp(x) - x - 1

"""Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
Divergence", 2020). With x = ref_logp - logp = log(ref/pi):
  k1 = -x               unbiased, high variance, can be negative
  k2 = x^2 / 2          biased, low variance, >= 0
  k3 = exp(x) - x - 1   unbiased, low variance, >= 0 (the KL penalty of GRPO, DeepSeekMath eq. 4)

and the closed-form KL between two Gaussian SDE steps of a flow-matching policy (`flow_kl`,
Flow-GRPO's KL to the reference).
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


def flow_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) per element, averaged per sample -> (B,) float32.

    mean, ref_mean: (B, ...) transition means of the policy and the reference at the same x_t;
    std: the transition's standard deviation (`SDEStepOutput.std`), a float or a tensor whose
    dims align with the leading dims of mean, e.g. (B,) or (B, S).
    kl = mean over non-batch dims of (mean - ref_mean)^2 / (2*std^2).
    """
    if ref_mean.shape != mean.shape:
        raise ValueError(f"flow_kl: ref_mean has shape {tuple(ref_mean.shape)}, mean has {tuple(mean.shape)}")
    s = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    s = s.reshape(*s.shape, *([1] * (mean.dim() - s.dim())))
    per_element = (mean.to(torch.float32) - ref_mean.to(torch.float32)).square() / (2 * s.square())
    return per_element.mean(dim=tuple(range(1, mean.dim()))) if mean.dim() > 1 else per_element

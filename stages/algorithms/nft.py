"""DiffusionNFT (Zheng et al. 2025): online RL on the forward (noising) process, with no
likelihoods. The reward splits each sample softly into positive and negative; the policy is
trained so that an implicit positive velocity (moved towards v_new) reconstructs positive samples
and an implicit negative velocity (reflected through v_old) reconstructs negative ones.

Symbols: x0 = clean sample, xt = (1-t)*x0 + t*noise, t = noise level, v_new = v_theta(xt, t),
v_old = the old (EMA) policy's velocity, r = optimality probability p, beta = guidance strength.
"""
from __future__ import annotations

import torch

from stages.algorithms.aggregate import LossOutput


def nft_loss(
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: float | torch.Tensor,
    v_new: torch.Tensor,
    v_old: torch.Tensor,
    adv: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip: float = 5.0,
    adaptive_weight: bool = True,
) -> LossOutput:
    """x0, xt, v_new, v_old: (B, ...); t: float or (B,) per sample; adv: (B,).

    c = adv_clip; p = clamp(clamp(adv, -c, c)/c/2 + 0.5, 0, 1);
    pos = beta*v_new + (1-beta)*v_old; neg = (1+beta)*v_old - beta*v_new;
    x0p = xt - t*pos; x0n = xt - t*neg;
    w+- = detached mean over non-batch dims of |x0+- - x0|, clamped at 1e-5 (1 without adaptive_weight);
    loss = c * mean_b(p*mse(x0p, x0)/wp + (1-p)*mse(x0n, x0)/wn) / beta, mse per sample.
    Metrics: pos_mse, neg_mse (batch means of the unweighted per-sample mse), p_mean.
    """
    name = "nft_loss"
    if beta <= 0 or adv_clip <= 0:
        raise ValueError(f"{name}: need beta > 0 and adv_clip > 0, got beta={beta}, adv_clip={adv_clip}")
    for label, tensor in (("xt", xt), ("v_new", v_new), ("v_old", v_old)):
        if tensor.shape != x0.shape:
            raise ValueError(f"{name}: {label} has shape {tuple(tensor.shape)}, x0 has {tuple(x0.shape)}")
    if adv.shape != x0.shape[:1]:
        raise ValueError(f"{name}: adv must be (B,) = ({x0.shape[0]},), got {tuple(adv.shape)}")
    dims = tuple(range(1, x0.dim()))

    def per_sample_mean(e: torch.Tensor) -> torch.Tensor:
        return e.mean(dim=dims) if dims else e

    x0 = x0.detach().to(torch.float32)
    xt = xt.detach().to(torch.float32)
    v_new = v_new.to(torch.float32)
    v_old = v_old.detach().to(torch.float32)
    tt = torch.as_tensor(t, dtype=torch.float32, device=x0.device)
    tt = tt.reshape(*tt.shape, *([1] * (x0.dim() - tt.dim())))

    c = adv_clip
    p = (adv.detach().to(torch.float32).clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)
    pos = beta * v_new + (1 - beta) * v_old
    neg = (1 + beta) * v_old - beta * v_new
    x0p = xt - tt * pos
    x0n = xt - tt * neg
    if adaptive_weight:
        wp = per_sample_mean((x0p.detach() - x0).abs()).clamp_min(1e-5)
        wn = per_sample_mean((x0n.detach() - x0).abs()).clamp_min(1e-5)
    else:
        wp = wn = torch.ones_like(p)
    mse_p = per_sample_mean((x0p - x0).square())
    mse_n = per_sample_mean((x0n - x0).square())
    loss = c * (p * mse_p / wp + (1 - p) * mse_n / wn).mean() / beta
    values = torch.stack([mse_p.mean(), mse_n.mean(), p.mean()]).detach().tolist()
    return LossOutput(loss, dict(zip(("pos_mse", "neg_mse", "p_mean"), values)))

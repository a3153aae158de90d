"""The flow-matching policy losses (docs/architecture.md, "The math contract"): Flow-GRPO's
per-SDE-step clipped surrogate, Flow-DPPO's divergence-gated one, DiffusionNFT's forward-process
loss and its draws of noise levels, and the velocity regression of flow on-policy distillation."""
from __future__ import annotations

from typing import Any

import torch

from unirl.stages.kernels.aggregate import LossOutput, loss_metrics
from unirl.stages.runtime.seeds import derive_seed


def step_advantages(adv: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """adv (B,) or (B, S) -> detached float32 (B, S) shaped like `like`."""
    if adv.shape not in (like.shape[:1], like.shape):
        raise ValueError(f"{name}: adv must be (B,) or (B, S) = {tuple(like.shape)}, got {tuple(adv.shape)}")
    a = adv.detach().to(torch.float32)
    return a[:, None].expand_as(like) if a.dim() == 1 else a


def step_weights(weights: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor | float:
    """The correction's per-step weights (B, S), detached float32; 1 without them."""
    if weights is None:
        return 1.0
    if weights.shape != like.shape:
        raise ValueError(f"{name}: weights must be (B, S) = {tuple(like.shape)}, got {tuple(weights.shape)}")
    return weights.detach().to(torch.float32)


def check_step_logps(logp: torch.Tensor, old_logp: torch.Tensor, name: str) -> None:
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be (B, S), one log-prob per trained step, got {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(f"{name}: old_logp has shape {tuple(old_logp.shape)}, logp has {tuple(logp.shape)}")


def flow_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip: float = 5.0,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """logp, old_logp: (B, S); adv: (B,) per sample (or (B, S)); weights: (B, S) importance
    weights of the off-policy correction (detached; None: 1).

    A = clip(adv, -adv_clip, adv_clip); r = exp(logp - old_logp);
    loss = mean over (B, S) of w * max(-A*r, -A*clip(r, 1-eps, 1+eps)).
    Metrics: clip_frac(_low/_high), approx_kl = mean((logp-old)^2)/2, ratio_mean/min/max.
    """
    check_step_logps(logp, old_logp, "flow_grpo_loss")
    if not 0 <= clip_range < 1 or adv_clip <= 0:
        raise ValueError(f"flow_grpo_loss: need 0 <= clip_range < 1 and adv_clip > 0, got {clip_range}, {adv_clip}")
    log_ratio = logp.to(torch.float32) - old_logp.detach().to(torch.float32)
    a = step_advantages(adv, log_ratio, "flow_grpo_loss").clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = (step_weights(weights, ratio, "flow_grpo_loss") * torch.maximum(-a * ratio, -a * clipped)).mean()
    ones = torch.ones_like(ratio)
    metrics = loss_metrics(
        log_ratio, ones, ratio, ones,
        clipped_low=(ratio < 1 - clip_range) & (a < 0),
        clipped_high=(ratio > 1 + clip_range) & (a > 0),
    )
    return LossOutput(loss, metrics)


def flow_dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: float | torch.Tensor,
    *,
    threshold: float = 1e-5,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """logp, old_logp: (B, S); adv: (B,) (or (B, S)); mean, old_mean: (B, S, ...) transition means;
    std: transition standard deviation, a float or a tensor aligned with the leading dims, e.g. (B, S);
    weights: (B, S) importance weights of the off-policy correction (detached; None: 1).

    r = exp(logp - old_logp); k (B, S) = mean over the dims after S of (mean - old_mean)^2 / (2*std^2);
    drop = k >= threshold and ((r > 1 and A > 0) or (r < 1 and A < 0));
    loss = mean over (B, S) of w * where(drop, 0, -A*r).
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
    loss = (step_weights(weights, ratio, name) * torch.where(drop, torch.zeros_like(ratio), -a * ratio)).mean()
    ones = torch.ones_like(ratio)
    metrics = loss_metrics(
        log_ratio, ones, ratio, ones,
        clipped_low=drop & pushed_down,
        clipped_high=drop & pushed_up,
    )
    metrics["drop_frac"] = drop.float().mean().item()
    return LossOutput(loss, metrics)


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


def nft_draws(sample_ids: list[str], *, seed: int, iteration: int, update: int, draw: int,
              sigmas: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(t (B,), noise (B, *shape)) of NFT draw `draw`: t uniform over the schedule's nonzero
    sigmas and the noise, both from a generator per sample, so a sample's draws do not depend on
    its micro-batch."""
    levels = sigmas[sigmas > 0]
    ts, noises = [], []
    for sid in sample_ids:
        g = torch.Generator().manual_seed(derive_seed(seed, "nft", iteration, update, draw, sid))
        ts.append(levels[int(torch.randint(0, levels.numel(), (1,), generator=g))])
        noises.append(torch.randn(shape, generator=g))
    return torch.stack(ts), torch.stack(noises)


def nft_points(batch: Any, *, seed: int, iteration: int, update: int, draws: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(t (B,), x_t (B, *latent)) of each NFT draw: x_t = (1 - t) * x0 + t * noise."""
    x0 = batch.final
    out = []
    for d in range(draws):
        t, noise = nft_draws(batch.sample_ids, seed=seed, iteration=iteration, update=update, draw=d,
                             sigmas=batch.plan.sigmas, shape=tuple(x0.shape[1:]))
        t, noise = t.to(x0.device), noise.to(x0.device)
        s = t.reshape(-1, *([1] * (x0.ndim - 1)))
        out.append((t, (1 - s) * x0 + s * noise))
    return out


def flow_opd_loss(v_student: torch.Tensor, v_teacher: torch.Tensor, weight: float | torch.Tensor = 1.0) -> LossOutput:
    """v_student, v_teacher: (N, *latent), one row per (sample, SDE step); weight: float or (N,).

    mse_n = mean over the non-batch dims of (v_student - v_teacher)^2;
    loss = mean_n(weight_n * mse_n); the teacher is detached.
    Metrics: opd_mse = mean_n(mse_n) (unweighted).
    """
    if v_teacher.shape != v_student.shape:
        raise ValueError(f"flow_opd_loss: v_teacher has shape {tuple(v_teacher.shape)}, v_student has {tuple(v_student.shape)}")
    w = torch.as_tensor(weight, dtype=torch.float32, device=v_student.device)
    if w.dim() > 1 or (w.dim() == 1 and w.shape != v_student.shape[:1]):
        raise ValueError(f"flow_opd_loss: weight must be a float or (N,) = ({v_student.shape[0]},), got {tuple(w.shape)}")
    err = (v_student.to(torch.float32) - v_teacher.detach().to(torch.float32)).square()
    mse = err.reshape(err.shape[0], -1).mean(dim=1)
    return LossOutput((w * mse).mean(), {"opd_mse": float(mse.detach().mean())})

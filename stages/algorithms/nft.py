"""DiffusionNFT (Zheng et al. 2025): online RL on the forward (noising) process, with no
likelihoods. The reward splits each sample softly into positive and negative; the policy is
trained so that an implicit positive velocity (moved towards v_new) reconstructs positive samples
and an implicit negative velocity (reflected through v_old) reconstructs negative ones.

Symbols: x0 = clean sample, xt = (1-t)*x0 + t*noise, t = noise level, v_new = v_theta(xt, t),
v_old = the old (EMA) policy's velocity, r = optimality probability p, beta = guidance strength.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from unirl.stages.algorithms.aggregate import LossOutput
from unirl.stages.algorithms.base import Algorithm, TrainContext, algorithms
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.seeds import derive_seed


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


class NFTConfig(Section):
    """DiffusionNFT: negative-aware fine-tuning with an EMA old policy (`train.ema`), which samples
    the rollouts and gives v_old."""

    name: Literal["nft"] = "nft"
    beta: float = Field(1.0, gt=0, description="Guidance strength beta.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip c.")
    adaptive_weight: bool = Field(True, description="Normalize by the detached x0 error.")
    timesteps: int = Field(4, ge=1, description="Noise levels t drawn per sample and update (gradient accumulated).")
    ema_ramp: float = Field(
        0.0, ge=0,
        description="Decay schedule of the old policy: decay at optimizer step k is min(train.ema.decay, "
        "ramp * (k - ema_flat_steps)) and 0 before ema_flat_steps; 0: train.ema.decay from the start.",
    )
    ema_flat_steps: int = Field(0, ge=0, description="Steps with decay 0 (old policy = current policy) before the ramp.")

    def ema_decay(self, step: int, max_decay: float) -> float:
        """The old policy's EMA decay at optimizer step `step` (0-based)."""
        if step < self.ema_flat_steps:
            return 0.0
        if self.ema_ramp == 0:
            return max_decay
        return min(max_decay, self.ema_ramp * (step - self.ema_flat_steps))


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


@algorithms.register("nft")
class NFT(Algorithm):
    """DiffusionNFT over `timesteps` draws per sample; backward per draw. The EMA old policy
    samples the rollouts and gives v_old at each draw, computed before any step."""

    name = "nft"
    config = NFTConfig
    segment = "latent"
    samples_with_ema = True
    anchors = ("latents",)

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.train.ema is None:
            raise ValueError(
                "train.ema: algorithm `nft` samples with and regresses against an EMA old policy; set "
                "`train: {ema: {decay: 0.9}}` (see recipes/diffusion/nft.yaml)"
            )

    def ema_decay(self, step: int, decay: float) -> float:
        return self.cfg.ema_decay(step, decay)

    def _points(self, ctx: TrainContext, batch: Any, update: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return nft_points(batch, seed=ctx.seed, iteration=ctx.iteration, update=update, draws=self.cfg.timesteps)

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        velocity = ctx.policy.velocity(ctx.module, batch.prompts)
        return [velocity(xt, tt) for tt, xt in self._points(ctx, batch, update)]

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        c = self.cfg
        weight = share * ctx.world
        totals: dict[str, float] = {}
        points = self._points(ctx, batch, update)
        if len(frozen) != len(points):
            raise ValueError(f"nft: {len(frozen)} old velocities for {len(points)} draws")
        velocity = ctx.policy.velocity(ctx.module, batch.prompts)
        for (t, xt), old in zip(points, frozen):
            res = nft_loss(batch.final, xt, t, velocity(xt, t), old, batch.advantage, beta=c.beta, adv_clip=c.adv_clip,
                           adaptive_weight=c.adaptive_weight)
            (res.loss * (weight / len(points))).backward()
            metrics = dict(res.metrics)
            metrics["loss"] = float(res.loss.detach())
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value) * (1.0 / len(points))
        return totals

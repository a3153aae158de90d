"""DiffusionNFT (Zheng et al. 2025): online RL on the forward (noising) process, with no
likelihoods. The reward splits each sample softly into positive and negative; the policy is
trained so that an implicit positive velocity (moved towards v_new) reconstructs positive samples
and an implicit negative velocity (reflected through v_old) reconstructs negative ones.

Symbols: x0 = clean sample, xt = (1-t)*x0 + t*noise, t = noise level, v_new = v_theta(xt, t),
v_old = the old (EMA) policy's velocity, r = optimality probability p, beta = guidance strength.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.algorithms.base import Algorithm, TrainContext
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


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

    def _points(self, ctx: TrainContext, batch: Any, update: int) -> list[tuple[Any, Any]]:
        from unirl.stages.kernels.flow_losses import nft_points  # start-up time: torch loads at the first train step

        return nft_points(batch, seed=ctx.seed, iteration=ctx.iteration, update=update, draws=self.cfg.timesteps)

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        velocity = ctx.policy.velocity(ctx.module, batch.prompts)
        return [velocity(xt, tt) for tt, xt in self._points(ctx, batch, update)]

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        from unirl.stages.kernels.flow_losses import nft_loss  # start-up time: torch loads at the first train step

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

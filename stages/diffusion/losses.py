"""One micro-batch of a diffusion policy update: the algorithm's loss over the stored trajectory,
with the backward pass taken per timestep (gradient accumulation across timesteps), so only one
transformer graph is alive at a time.

* flow_grpo / flow_dppo: for each SDE step j, replay x_j -> x_{j+1} under the current velocity
  (`stages.diffusion.sampling.replay_step`), then the clipped (Flow-GRPO) or dropped (Flow-DPPO)
  ratio objective against the frozen old log-probs recorded at sampling time, plus the optional
  `flow_kl` to the reference policy. Total loss = mean over (samples, SDE steps).
* nft: for each of `timesteps` draws, t and noise per sample from a seeded generator,
  x_t = (1 - t) x_0 + t * noise, and DiffusionNFT's loss between the current velocity and the old
  (EMA) policy's velocity at x_t.

`weight` scales this micro-batch's share of the mini-batch loss (samples here / samples in the
mini-batch, summed over ranks); callers step the optimizer after all micro-batches.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stages.algorithms import flow_dppo_loss, flow_grpo_loss, flow_kl, nft_loss
from stages.diffusion.sampling import Velocity, derive_seed, replay_step
from stages.diffusion.trajectory import LatentBatch

LIKELIHOOD_ALGORITHMS = ("flow_grpo", "flow_dppo")


class OnPolicyRatioError(RuntimeError):
    """The first update of an iteration replayed log-probs that differ from the sampled ones."""


def _add(totals: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    for key, value in metrics.items():
        totals[key] = totals.get(key, 0.0) + float(value) * weight


@torch.no_grad()
def transition_means(velocity: Velocity, batch: LatentBatch) -> Tensor:
    """(B, K, C, h, w) means of every SDE transition under `velocity` (frozen old means for
    Flow-DPPO's later mini-batches)."""
    out = []
    for j, step in enumerate(batch.plan.sde_indices.tolist()):
        x = batch.at(step)
        sigma = batch.plan.sigmas[step].expand(x.shape[0])
        out.append(replay_step(batch.plan, step, x, velocity(x, sigma), batch.at(step + 1)).mean)
    return torch.stack(out, dim=1)


def likelihood_backward(
    algo: Any, batch: LatentBatch, adv: Tensor, velocity: Velocity, *, weight: float,
    ref_velocity: Velocity | None = None, old_means: Tensor | None = None, check_on_policy: bool = False,
    where: str = "",
) -> dict[str, float]:
    """Flow-GRPO / Flow-DPPO over the SDE steps of `batch`; backward per step. adv: (B,).
    Returns metrics summed with weight 1/K per step (so they average over steps).
    `check_on_policy`: raise OnPolicyRatioError unless every replayed log-prob equals the stored one."""
    plan = batch.plan
    steps = plan.sde_indices.tolist()
    if not steps:
        raise ValueError(f"{algo.name} trains on SDE steps, but the rollouts {where} were sampled with no SDE step "
                         "(rollout.sampler.sde_kind: ode or eta: 0)")
    k = len(steps)
    totals: dict[str, float] = {}
    for j, step in enumerate(steps):
        x = batch.at(step)
        sigma = plan.sigmas[step].expand(x.shape[0])
        out = replay_step(plan, step, x, velocity(x, sigma), batch.at(step + 1))
        logp = out.log_prob[:, None]
        old = batch.logprobs[:, j:j + 1]
        if check_on_policy and not torch.equal(logp.detach(), old):
            diff = (logp.detach() - old).abs().max().item()
            raise OnPolicyRatioError(
                f"first on-policy update {where}: replayed log-probs at SDE step {step} differ from the sampled ones "
                f"(max |diff| {diff:.3g}); sampling and training must see the same weights, batch and sigmas"
            )
        if algo.name == "flow_grpo":
            res = flow_grpo_loss(logp, old, adv, clip_range=algo.clip_range, adv_clip=algo.adv_clip)
        else:
            old_mean = out.mean.detach() if old_means is None else old_means[:, j]
            res = flow_dppo_loss(logp, old, adv, out.mean[:, None], old_mean[:, None], out.std[:, None],
                                 threshold=algo.threshold)
        loss = res.loss
        metrics = dict(res.metrics)
        kl_coef = getattr(algo, "kl_coef", 0.0)
        if ref_velocity is not None and kl_coef > 0:
            with torch.no_grad():
                ref_mean = replay_step(plan, step, x, ref_velocity(x, sigma), batch.at(step + 1)).mean
            kl = flow_kl(out.mean, ref_mean, out.std).mean()
            loss = loss + kl_coef * kl
            metrics["kl"] = float(kl.detach())
        metrics["loss"] = float(loss.detach())
        (loss * (weight / k)).backward()
        _add(totals, metrics, 1.0 / k)
    return totals


def nft_draws(sample_ids: list[str], *, seed: int, iteration: int, update: int, draw: int,
              sigmas: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
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


def nft_points(batch: LatentBatch, *, seed: int, iteration: int, update: int, draws: int) -> list[tuple[Tensor, Tensor]]:
    """(t (B,), x_t (B, C, h, w)) of each NFT draw: x_t = (1 - t) * x0 + t * noise."""
    x0 = batch.final
    out = []
    for d in range(draws):
        t, noise = nft_draws(batch.sample_ids, seed=seed, iteration=iteration, update=update, draw=d,
                             sigmas=batch.plan.sigmas, shape=tuple(x0.shape[1:]))
        t, noise = t.to(x0.device), noise.to(x0.device)
        s = t.reshape(-1, *([1] * (x0.ndim - 1)))
        out.append((t, (1 - s) * x0 + s * noise))
    return out


def nft_backward(
    algo: Any, batch: LatentBatch, adv: Tensor, velocity: Velocity, v_old: list[Tensor], *, weight: float,
    seed: int, iteration: int, update: int,
) -> dict[str, float]:
    """DiffusionNFT over `algo.timesteps` draws per sample; backward per draw. `v_old`: the old
    (EMA) policy's velocity at each draw (`nft_points` order), computed before any step."""
    totals: dict[str, float] = {}
    points = nft_points(batch, seed=seed, iteration=iteration, update=update, draws=algo.timesteps)
    if len(v_old) != len(points):
        raise ValueError(f"nft_backward: {len(v_old)} old velocities for {len(points)} draws")
    for (t, xt), old in zip(points, v_old):
        res = nft_loss(batch.final, xt, t, velocity(xt, t), old, adv, beta=algo.beta, adv_clip=algo.adv_clip,
                       adaptive_weight=algo.adaptive_weight)
        (res.loss * (weight / len(points))).backward()
        metrics = dict(res.metrics)
        metrics["loss"] = float(res.loss.detach())
        _add(totals, metrics, 1.0 / len(points))
    return totals

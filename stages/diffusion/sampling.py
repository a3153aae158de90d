"""The sampling plan of an iteration and the sampling loop over a velocity model.

A plan is the sigma schedule (T+1 values from 1 to 0) and the SDE steps of the iteration
(`unirl.stages.diffusion.sde.select_sde_steps`); every other step is an ODE (Euler) step. The loop stores x only
at the steps training needs (`stored_steps`) and records, for each SDE step, the log-probability
that `unirl.stages.diffusion.sde.sde_step` gives the sampled transition. Training replays those transitions with
`replay_step`, which calls the same kernel on the same inputs, so with the same weights and the
same batch the replayed log-prob equals the recorded one bit for bit: the first on-policy ratio
is exactly 1.

Randomness: the initial noise comes from `unirl.stages.diffusion.sde.initial_noise` (per group or per sample) and
every sample draws its SDE noise from its own generator (`noise_seed`), so a sample does not
depend on the batch or the rank that made it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from unirl.stages.diffusion.kernels import ODE
from unirl.stages.diffusion.sde import SDEStepOutput, dynamic_shift, sde_step, select_sde_steps, shifted_sigmas, time_shift_sigmas
from unirl.stages.runtime.registry import kernels
from unirl.stages.runtime.seeds import derive_seed

# v = velocity(x (B, *latent), sigma (B,)) -> (B, *latent) float32; the prompts are bound inside.
Velocity = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Plan:
    """sigmas: (T+1,) float32 from 1 to 0; sde_indices: sorted (K,) int64 steps in [0, T)."""

    sigmas: Tensor
    sde_indices: Tensor
    kind: str
    eta: float

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def sigma_max(self) -> float:
        """The largest sigma below 1 (sigmas[1]); the flow kernel uses it at sigma == 1."""
        return float(self.sigmas[1]) if self.num_steps > 1 else 0.5

    @property
    def stochastic(self) -> bool:
        return self.kind != ODE and self.eta > 0 and self.sde_indices.numel() > 0


def make_plan(sampler: Any, *, seed: int, iteration: int, latent_tokens: int, deterministic: bool = False,
              mu: Callable[[int, int], float] | None = None) -> Plan:
    """The plan of `iteration` from a `DiffusionSampler` section. `latent_tokens` (transformer
    tokens of one image or clip) sets the shift when `sampler.dynamic_shift`, through the family's
    `mu(tokens, num_steps)` (default `unirl.stages.diffusion.sde.dynamic_shift`). The `window` draw uses a generator
    seeded from (seed, iteration). `deterministic`: an ODE plan (evaluation)."""
    t = sampler.num_steps
    if sampler.dynamic_shift:
        sigmas = time_shift_sigmas(t, mu(latent_tokens, t) if mu is not None else dynamic_shift(latent_tokens))
    else:
        sigmas = shifted_sigmas(t, sampler.shift)
    if deterministic or kernels.get(sampler.kernel).deterministic or sampler.eta == 0:
        return Plan(sigmas, torch.zeros(0, dtype=torch.long), ODE, 0.0)
    sel = sampler.sde_steps
    generator = torch.Generator().manual_seed(derive_seed(seed, "sde-steps", iteration))
    indices = select_sde_steps(
        t, mode=sel.selection, window=sel.window, window_size=sel.window_size, num_sde_steps=sel.num_sde_steps,
        generator=generator, iteration=iteration, stride=sel.stride, shift_every=sel.shift_every, wrap=sel.wrap,
    )
    return Plan(sigmas, indices, sampler.kernel, float(sampler.eta))


def stored_steps(sde_indices: Sequence[int], num_steps: int, *, transitions: bool = True) -> list[int]:
    """Steps (0..T) whose x the trajectory keeps: x_i and x_{i+1} of every SDE step i (when
    `transitions`, for likelihood-based losses) and always the final x_T (the sample)."""
    keep = {int(num_steps)}
    if transitions:
        for i in sde_indices:
            keep.update((int(i), int(i) + 1))
    return sorted(keep)


@dataclass
class Trajectory:
    """latents: (B, N, *latent) float32, x at `stored` steps; logprobs: (B, K) float32 at the
    plan's SDE steps (K = 0 for an ODE plan); final: (B, *latent), x at sigma = 0."""

    latents: Tensor
    stored: list[int]
    logprobs: Tensor
    final: Tensor


def replay_step(plan: Plan, step: int, x: Tensor, v: Tensor, x_next: Tensor) -> SDEStepOutput:
    """Score the stored transition x (at sigmas[step]) -> x_next under velocity v: log_prob (B,),
    mean (B, *latent), std (B,). The same call the sampler makes, so the same inputs give the
    same bits."""
    b = x.shape[0]
    s = plan.sigmas[step].to(x.device).expand(b)
    s_next = plan.sigmas[step + 1].to(x.device).expand(b)
    return sde_step(plan.kind, x, v, s, s_next, eta=plan.eta, sigma_max=plan.sigma_max, prev_sample=x_next)


@torch.no_grad()
def sample(velocity: Velocity, x: Tensor, plan: Plan, noise_seeds: Sequence[int], *, store: Sequence[int]) -> Trajectory:
    """Run the T steps of `plan` from x = x_0 (B, *latent: C, h, w or C, F, h, w) at sigma = 1.

    SDE steps draw x' = mean + std * noise with noise from each sample's generator (seeded
    `noise_seeds[b]`), then score x' with `replay_step`; ODE steps are Euler steps. Returns the
    trajectory at the `store` steps (see `stored_steps`)."""
    x = x.float()
    b = x.shape[0]
    generators = [torch.Generator().manual_seed(int(s)) for s in noise_seeds]
    if len(generators) != b:
        raise ValueError(f"{len(generators)} noise seeds for a batch of {b}")
    sde = set(int(i) for i in plan.sde_indices) if plan.stochastic else set()
    keep = {int(i) for i in store}
    saved: dict[int, Tensor] = {0: x} if 0 in keep else {}
    logprobs: list[Tensor] = []
    for i in range(plan.num_steps):
        sigma = plan.sigmas[i].to(x.device).expand(b)
        v = velocity(x, sigma)
        if i in sde:
            probe = replay_step(plan, i, x, v, x)  # mean and std of the transition
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)
            x_next = probe.mean + probe.std.reshape(b, *([1] * (x.ndim - 1))) * noise
            out = replay_step(plan, i, x, v, x_next)
            assert out.log_prob is not None, "an SDE step scores its transition"
            logprobs.append(out.log_prob)
            x = out.prev_sample
        else:
            s_next = plan.sigmas[i + 1].to(x.device).expand(b)
            x = sde_step(ODE, x, v, sigma, s_next, eta=0.0, sigma_max=plan.sigma_max).prev_sample
        if i + 1 in keep:
            saved[i + 1] = x
    order = sorted(saved)
    latents = torch.stack([saved[i] for i in order], dim=1)
    lp = torch.stack(logprobs, dim=1) if logprobs else x.new_zeros(b, 0)
    return Trajectory(latents, order, lp, x)

"""Sampling math for flow-matching models: sigma schedules, one SDE step of a registered kernel
(stages/diffusion/kernels/) with its log-probability, SDE-step selection, seeded initial noise and the sigma verification boundary.

Conventions (rectified flow, as in SD3): x_sigma = (1 - sigma) * x0 + sigma * noise, sigma runs from
1 (pure noise) to 0 (data), the model predicts the velocity v = noise - x0, and one step goes from
`sigma` to `sigma_next` < `sigma`, so dt = sigma_next - sigma is negative.

`sde_step` is the one kernel used both at sampling time and at training-time replay: the same
inputs give bit-identical log-probs, which is what makes the first on-policy ratio exactly 1.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from unirl.stages.diffusion.kernels import ODE, Step
from unirl.stages.kernels.schedules import dynamic_shift, shift_sigmas, shifted_sigmas, time_shift_sigmas  # noqa: F401 (re-exported)
from unirl.stages.runtime.registry import kernels
from unirl.stages.runtime.seeds import derive_seed

# ---------------------------------------------------------------- the step kernel


@dataclass(frozen=True)
class SDEStepOutput:
    """One denoising step, all float32.

    prev_sample: (B, ...) x at sigma_next (sampled, or the given one when scoring).
    log_prob:    (B,) log-probability of prev_sample (None for an ODE step).
    mean:        (B, ...) mean of the transition x_next | x.
    std:         (B,) standard deviation of the transition Gaussian (the contract's `scale`:
                 std*sqrt(-dt) for flow/dance, std for cps, 0 for ode); `flow_kl` takes it.
    """

    prev_sample: Tensor
    log_prob: Tensor | None
    mean: Tensor
    std: Tensor


def _per_sample(value: float | Tensor, batch: int, device: torch.device, name: str) -> Tensor:
    """A python float or a (B,)/(1,)/() tensor -> (B,) float32 on `device`."""
    out = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    if out.numel() == 1:
        return out.expand(batch)
    if out.numel() != batch:
        raise ValueError(f"{name} has {out.numel()} values for a batch of {batch}; pass a float or a (B,) tensor")
    return out


def _bcast(per_sample: Tensor, ndim: int) -> Tensor:
    """(B,) -> (B, 1, ..., 1) with `ndim` dims, to broadcast over a sample's other dims."""
    return per_sample.reshape(-1, *([1] * (ndim - 1)))


def sde_step(
    kind: str,
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    eta: float,
    sigma_max: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStepOutput:
    """One step x (at sigma) -> x' (at sigma_next), sampled, or scored when `prev_sample` is given.

    x, v: (B, ...) latent x_t and predicted velocity v_theta(x_t, t). sigma, sigma_next: floats or
    (B,) tensors (t and t - dt in the papers' notation). eta: noise level (Flow-GRPO's `a`,
    "noise_level"; DanceGRPO's constant eta; CPS's eta in [0, 1]). sigma_max: the largest sigma
    below 1 of the schedule (sigmas[1]), used in place of sigma = 1 where sigma/(1-sigma) is infinite.

    dt = sigma_next - sigma < 0.
    * flow (Flow-GRPO, the SDE with the same marginals as the flow ODE):
        std = eta*sqrt(sigma/(1-s)), s = sigma_max if sigma == 1 else sigma   (sigma_t in the paper)
        mean = x*(1 + std^2/(2*sigma)*dt) + v*(1 + std^2*(1-sigma)/(2*sigma))*dt
        x' ~ N(mean, scale^2), scale = std*sqrt(-dt)
    * dance (DanceGRPO): as flow with a constant std = eta.
    * cps (coefficients-preserving sampling): x0 = x - sigma*v, x1 = x + (1-sigma)*v are the predicted
        data and noise; std = sigma_next*sin(eta*pi/2);
        mean = x0*(1-sigma_next) + x1*sqrt(sigma_next^2 - std^2); x' = mean + std*noise;
        log_prob = -mean((x'-mean)^2) (the Gaussian's constants and 1/(2 std^2) dropped, as in CPS).
    * ode, or any kind with eta == 0: the Euler step x' = x + v*dt, log_prob None.
    For flow and dance, log_prob is the per-element mean over the non-batch dims of
    log N(x'; mean, scale^2), constants included.

    All math is float32 and sigmas are made float32 tensors first, so a float sigma at sampling and
    a (B,) tensor of the same values at replay give bit-identical results. Shapes: see SDEStepOutput.
    """
    kernel = kernels.get(kind)  # an unknown kind names the allowed ones
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    x = x.float()
    v = v.float()
    if v.shape != x.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but x has {tuple(x.shape)}")
    batch, ndim = x.shape[0], x.ndim
    sig = _per_sample(sigma, batch, x.device, "sigma")
    sig_next = _per_sample(sigma_next, batch, x.device, "sigma_next")
    step = Step(x, v, sig, _bcast(sig, ndim), _bcast(sig_next, ndim), float(eta), sigma_max)
    mean, scale, log_prob_of = (kernels.get(ODE) if eta == 0 else kernel).moments(step)
    if log_prob_of is None:  # a deterministic step
        out = mean if prev_sample is None else prev_sample.float()
        return SDEStepOutput(out, None, mean, torch.zeros_like(sig))

    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        prev_sample = mean + scale * noise
    else:
        prev_sample = prev_sample.float()
    return SDEStepOutput(prev_sample, log_prob_of(prev_sample, mean, scale), mean, scale.reshape(batch))


# ---------------------------------------------------------------- which steps are SDE steps


def _fraction_range(num_steps: int, window: Sequence[float] | None) -> tuple[int, int]:
    """Steps i with lo <= i/T < hi, as the half-open index range [first, end)."""
    lo, hi = (0.0, 1.0) if window is None else (float(window[0]), float(window[1]))
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"window must be [lo, hi] fractions with 0 <= lo < hi <= 1, got {list(window or ())}")
    # The epsilon keeps 0.6 * 10 = 6.000000000000001 at index 6.
    return math.ceil(lo * num_steps - 1e-9), math.ceil(hi * num_steps - 1e-9)


def select_sde_steps(
    num_steps: int,
    *,
    mode: str,
    window: Sequence[float] | None = None,
    window_size: int | None = None,
    num_sde_steps: int | None = None,
    generator: torch.Generator | None = None,
    iteration: int = 0,
    stride: int = 1,
    shift_every: int = 1,
    wrap: bool = False,
) -> Tensor:
    """Sorted (K,) int64 indices in [0, T) of the steps sampled with the SDE (and trained on);
    every other step is an ODE step.

    `window` = [lo, hi] restricts the steps to those with lo <= i/T < hi (default [0, 1]).
    * "all": every step.
    * "window" (Flow-GRPO-Fast style): a contiguous block [start, start + window_size) inside the
      range, start drawn uniformly from `generator`, then `num_sde_steps` steps of the block drawn
      without replacement (window_size defaults to the whole range, num_sde_steps to window_size).
      Pass a generator seeded per iteration so that the draw is reproducible.
    * "mixgrpo" (MixGRPO's progressive sliding window): a block of `window_size` steps starting at
      the range's first step and moving forward by `stride` every `shift_every` iterations. At the
      end of the range it stays at the last position (clamp, the default) or, with wrap=True,
      restarts from the first (MixGRPO's "roll back").
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown SDE step selection mode {mode!r}; allowed: {', '.join(SELECTION_MODES)}")
    return _SELECTIONS[mode](num_steps, window, window_size, num_sde_steps=num_sde_steps, generator=generator,
                             iteration=iteration, stride=stride, shift_every=shift_every, wrap=wrap)


def _block(num_steps: int, window: Sequence[float] | None, window_size: int | None) -> tuple[int, int, int]:
    """(first step, number of steps) of the window's range and the block's size."""
    first, end = _fraction_range(num_steps, window)
    span = end - first
    size = span if window_size is None else int(window_size)
    if size < 1:
        raise ValueError(f"window_size must be >= 1, got {size}")
    if size > span:
        raise ValueError(
            f"window_size {size} is larger than the {span} steps available (steps {first}..{end - 1} of "
            f"num_steps={num_steps}, window={list(window) if window is not None else [0, 1]}); "
            "lower window_size, widen window, or raise num_steps"
        )
    return first, span, size


def _select_all(num_steps: int, window: Sequence[float] | None, window_size: int | None, **_: Any) -> Tensor:
    return torch.arange(num_steps, dtype=torch.long)


def _select_window(num_steps: int, window: Sequence[float] | None, window_size: int | None, *,
                   num_sde_steps: int | None, generator: torch.Generator | None, **_: Any) -> Tensor:
    first, span, size = _block(num_steps, window, window_size)
    count = size if num_sde_steps is None else int(num_sde_steps)
    if not 1 <= count <= size:
        raise ValueError(f"num_sde_steps must be in [1, window_size={size}], got {count}")
    if generator is None and (size < span or count < size):
        raise ValueError(
            "mode 'window' draws steps at random: pass generator=torch.Generator().manual_seed(<seed per iteration>)"
        )
    start = first
    if size < span:
        start += int(torch.randint(0, span - size + 1, (1,), generator=generator).item())
    picked = torch.arange(size, dtype=torch.long)
    if count < size:
        picked = torch.randperm(size, generator=generator)[:count]
    return torch.sort(start + picked).values


def _select_sliding(num_steps: int, window: Sequence[float] | None, window_size: int | None, *,
                    iteration: int, stride: int, shift_every: int, wrap: bool, **_: Any) -> Tensor:
    first, span, size = _block(num_steps, window, window_size)
    if stride < 1 or shift_every < 1:
        raise ValueError(f"stride and shift_every must be >= 1, got {stride} and {shift_every}")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    moves = iteration // shift_every
    if wrap:
        positions = (span - size) // stride + 1
        offset = (moves % positions) * stride
    else:
        offset = min(moves * stride, span - size)
    start = first + offset
    return torch.arange(start, start + size, dtype=torch.long)


_SELECTIONS: dict[str, Callable[..., Tensor]] = {"all": _select_all, "window": _select_window, "mixgrpo": _select_sliding}
SELECTION_MODES = tuple(_SELECTIONS)


# ---------------------------------------------------------------- initial noise


def initial_noise(
    shape: Sequence[int],
    *,
    base_seed: int,
    group_id: int | str | None = None,
    sample_id: int | str | None = None,
    init_same_noise: bool = True,
) -> tuple[Tensor, int]:
    """Float32 N(0, 1) noise of `shape` (on CPU) and the seed it came from.

    The seed is derived from (base_seed, group_id) when `init_same_noise` (all samples of a group
    start from the same noise, so rewards differ only through the SDE noise) or from
    (base_seed, sample_id) otherwise.
    """
    if init_same_noise:
        if group_id is None:
            raise ValueError("init_same_noise=True derives the noise from the group: pass group_id")
        seed = derive_seed(base_seed, "group", group_id, sep=":")
    else:
        if sample_id is None:
            raise ValueError("init_same_noise=False derives the noise from the sample: pass sample_id")
        seed = derive_seed(base_seed, "sample", sample_id, sep=":")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32), seed


# ---------------------------------------------------------------- sigma verification boundary


class SigmaMismatchError(RuntimeError):
    """The engine sampled with sigmas other than the ones the trainer asked for."""


def check_sigmas(requested: Sequence[float] | Tensor, used: Sequence[float] | Tensor, *, atol: float = 1e-6) -> None:
    """Raise SigmaMismatchError unless `used` (echoed by the engine) equals `requested` within atol.

    Log-probs replayed with a different schedule than the one sampled are silently wrong, so any
    difference, including length, is an error.
    """
    req = torch.as_tensor(requested, dtype=torch.float64).reshape(-1).cpu()
    got = torch.as_tensor(used, dtype=torch.float64).reshape(-1).cpu()
    if req.numel() != got.numel():
        raise SigmaMismatchError(
            f"sigma schedule mismatch: requested {req.numel()} sigmas but the engine used {got.numel()}; "
            "check num_steps and the shift the engine was given"
        )
    bad = ((req - got).abs() > atol) | torch.isnan(got) | torch.isnan(req)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0].item())
        raise SigmaMismatchError(
            f"sigma schedule mismatch at index {i}: requested {req[i].item():.9g}, engine used "
            f"{got[i].item():.9g} (atol={atol}); {int(bad.sum())} of {req.numel()} sigmas differ. "
            "The engine's scheduler (shift, dynamic shifting, num_steps) must match the recipe."
        )

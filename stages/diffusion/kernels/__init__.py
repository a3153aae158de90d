"""SDE sampler kernels (`rollout.sampler.sde_kind`): one file each, registered in `kernels`.

A kernel maps one step's float32 inputs (`Step`) to the step's mean, its noise scale and the
log-probability of a sampled x' (docs/architecture.md, "The math contract"); `unirl.stages.diffusion.sde.sde_step` runs
it at sampling time and at replay alike. `sglang` is SGLang diffusion's `rollout_sde_type` for
the kernel (None: SGLang has no such kernel, and ours sends it as `extra_sampling_params.sde_kind`
to engines that serve it). `ode` is the deterministic Euler step every kernel falls back to at
eta 0.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unirl.stages.runtime.registry import kernels

if TYPE_CHECKING:
    from torch import Tensor

ODE = "ode"  # the deterministic kernel: held-out (greedy) images, and any step that is not an SDE step
LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class Step:
    """One step's float32 inputs: `sig` the (B,) sigmas, `s` and `s_next` broadcast to x's dims."""

    x: Tensor
    v: Tensor
    sig: Tensor
    s: Tensor
    s_next: Tensor
    eta: float
    sigma_max: float

    @property
    def dt(self) -> Tensor:
        return self.s_next - self.s


# step -> (mean, scale, log_prob(x', mean, scale)); log_prob None for a deterministic step.
Moments = tuple["Tensor", Any, Any]


@dataclass(frozen=True)
class Kernel:
    name: str
    moments: Callable[[Step], Moments]
    sglang: str | None = None  # SGLang diffusion's rollout_sde_type for this kernel

    @property
    def deterministic(self) -> bool:
        return self.name == ODE


def register(kernel: Kernel) -> Kernel:
    return kernels.register(kernel.name)(kernel)


def mean_over_sample(t: Tensor) -> Tensor:
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def gaussian_log_prob(prev: Tensor, mean: Tensor, scale: Tensor) -> Tensor:
    import torch  # start-up time: loaded on first use, not when a recipe is read

    return mean_over_sample(-((prev - mean) ** 2) / (2 * scale**2) - torch.log(scale) - LOG_SQRT_2PI)


def reverse_sde(st: Step, std: Tensor) -> Moments:
    """The SDE with the flow ODE's marginals, at noise std `std` (flow, dance)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    s, dt = st.s, st.dt
    mean = st.x * (1 + std**2 / (2 * s) * dt) + st.v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    return mean, std * torch.sqrt(-dt), gaussian_log_prob

"""Coefficients-preserving sampling: x0 = x - sigma*v and x1 = x + (1-sigma)*v are the predicted
data and noise; std = sigma_next*sin(eta*pi/2); mean = x0*(1-sigma_next) + x1*sqrt(sigma_next^2 -
std^2); log_prob = -mean((x'-mean)^2) (the Gaussian's constants and 1/(2 std^2) dropped, as in CPS)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from unirl.stages.diffusion.kernels import Kernel, Moments, Step, mean_over_sample, register

if TYPE_CHECKING:
    from torch import Tensor


def log_prob(prev: Tensor, mean: Tensor, scale: Tensor) -> Tensor:
    return -mean_over_sample((prev - mean) ** 2)


def moments(st: Step) -> Moments:
    import torch  # start-up time: loaded on first use, not when a recipe is read

    s, s_next = st.s, st.s_next
    std = s_next * math.sin(st.eta * math.pi / 2)
    x0 = st.x - s * st.v
    x1 = st.x + (1 - s) * st.v
    mean = x0 * (1 - s_next) + x1 * torch.sqrt((s_next**2 - std**2).clamp_min(0))
    return mean, std, log_prob


register(Kernel("cps", moments, sglang="cps"))

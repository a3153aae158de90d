"""Sigma schedules of flow-matching sampling (rectified flow, as in SD3: sigma runs from 1, pure
noise, to 0, data): the shifted schedule, the resolution-dependent shift mu of FLUX / SD3.5, and
the time-shifted schedule it gives (stages/diffusion/sde.py samples on them)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def shifted_sigmas(num_steps: int, shift: float) -> Tensor:
    """(T+1,) float32 sigmas from 1 to 0: t = linspace(1, 0, T+1); sigma = shift*t / (1 + (shift-1)*t).

    shift > 1 spends more steps at high noise (SD3 uses 3.0); shift = 1 is the plain linear schedule.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(t, shift).to(torch.float32)


def shift_sigmas(t: Tensor, shift: float) -> Tensor:
    """sigma = shift*t / (1 + (shift-1)*t), elementwise on t in [0, 1]; shift = 1 returns t."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def dynamic_shift(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Resolution-dependent shift mu (FLUX / SD3.5 "use_dynamic_shifting").

    mu is linear in the number of latent tokens: mu = base_shift at `base_seq_len` tokens and
    max_shift at `max_seq_len` tokens (extrapolated outside that range):
        mu = base_shift + (image_seq_len - base_seq_len) * (max_shift - base_shift) / (max_seq_len - base_seq_len)
    Use it with `time_shift_sigmas(num_steps, mu)`; the equivalent `shifted_sigmas` shift is exp(mu).
    """
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len and base_seq_len must differ, both are {base_seq_len}")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + (image_seq_len - base_seq_len) * slope


def time_shift_sigmas(num_steps: int, mu: float) -> Tensor:
    """(T+1,) float32 sigmas: sigma(t) = exp(mu) / (exp(mu) + (1/t - 1)) on t = linspace(1, 0, T+1).

    At t = 0 the formula's limit, 0, is used: it is `shift_sigmas(t, exp(mu))`, the schedule of
    `shifted_sigmas` with shift = exp(mu).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(t, math.exp(mu)).to(torch.float32)

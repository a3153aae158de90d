"""DanceGRPO's SDE: Flow-GRPO's with a constant std = eta. SGLang diffusion has no such kernel."""
from __future__ import annotations

import torch

from unirl.stages.diffusion.kernels import Kernel, Moments, Step, register, reverse_sde


def moments(st: Step) -> Moments:
    return reverse_sde(st, torch.full_like(st.s, st.eta))


register(Kernel("dance", moments))

"""DanceGRPO's SDE: Flow-GRPO's with a constant std = eta. SGLang diffusion has no such kernel."""
from __future__ import annotations

from unirl.stages.diffusion.kernels import Kernel, Moments, Step, register, reverse_sde


def moments(st: Step) -> Moments:
    import torch  # start-up time: loaded on first use, not when a recipe is read

    return reverse_sde(st, torch.full_like(st.s, st.eta))


register(Kernel("dance", moments))

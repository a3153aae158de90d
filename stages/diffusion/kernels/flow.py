"""Flow-GRPO's SDE, with the flow ODE's marginals: std = eta*sqrt(sigma/(1-s)), s = sigma_max
where sigma == 1 (sigma_t in the paper)."""
from __future__ import annotations

from unirl.stages.diffusion.kernels import Kernel, Moments, Step, register, reverse_sde


def moments(st: Step) -> Moments:
    import torch  # start-up time: loaded on first use, not when a recipe is read

    if bool((st.sig == 1).any()) and not 0 < st.sigma_max < 1:
        raise ValueError(
            f"sigma_max must be in (0, 1) for kind 'flow' at sigma == 1, got {st.sigma_max}; "
            "pass the schedule's sigmas[1]"
        )
    s_max = torch.tensor(st.sigma_max, dtype=torch.float32, device=st.x.device)
    s_eff = torch.where(st.s == 1, s_max, st.s)
    return reverse_sde(st, st.eta * torch.sqrt(st.s / (1 - s_eff)))


register(Kernel("flow", moments, sglang="sde"))

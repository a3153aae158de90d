"""The Euler step x' = x + v*dt: deterministic, no log-probability."""
from __future__ import annotations

from unirl.stages.diffusion.kernels import ODE, Kernel, Moments, Step, register


def moments(st: Step) -> Moments:
    return st.x + st.v * st.dt, None, None


register(Kernel(ODE, moments, sglang="ode"))

"""Flow-GRPO with the coefficients-preserving sampler (CPS, Wang et al. 2025): the SDE step keeps
the noise level of the schedule exactly (`sde_kind: cps`), and its log-prob drops the Gaussian's
constants (docs/architecture.md, "The math contract")."""
from __future__ import annotations

from typing import Any, Literal

from unirl.stages.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.stages.runtime.registry import algorithms


class CPSConfig(FlowGRPOConfig):
    """Flow-GRPO with the coefficients-preserving sampler (rollout.sampler.sde_kind: cps)."""

    name: Literal["cps"] = "cps"  # type: ignore[assignment]


@algorithms.register("cps")
class CPS(FlowGRPO):
    name = "cps"
    config = CPSConfig

    @classmethod
    def sampler_defaults(cls) -> dict[str, Any]:
        return {"sde_kind": "cps"}

"""Off-policy correction (docs/architecture.md, "The math contract"): rollouts sampled by an engine, or by an older
policy version (async RL, `sync.every` > 1), carry behaviour log-probs b that differ from the
trainer's proximal log-probs o (its replay before the batch's first step). The correction
reweights or drops tokens by the importance ratio o/b:

  token level     w_t = exp(o_t - b_t)                         (B, L)
  sequence level  w   = exp(sum_t (o_t - b_t) m_t)              (B,)
  truncate        w <- min(w, C)                                 truncated IS (Espeholt et al. 2018; TIS)
  mask            w <- w where w in [lo, hi] (default [1/C, C]), else 0   rejection of far-off samples

w is detached and multiplies each token's (or sequence's) loss. Every loss kernel here
(grpo_loss, gspo_loss, drpo_loss) is positively homogeneous in the advantage, l(w*A) = w*l(A) for
w >= 0, so the weighted loss is the kernel applied to w*A: the kernels stay as docs/architecture.md states them.

Objectives. `decoupled` (Hilton et al. 2022, "Batch size-invariance for policy optimization";
AReaL's decoupled PPO): the PPO ratio and its clip are taken against the proximal policy o, and w
corrects from the behaviour policy b to o. `behaviour`: the PPO ratio is taken against b itself
(no recomputed old policy enters the loss); only masking applies.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from unirl.stages.runtime.config_base import Section


class CorrectionConfig(Section):
    """Off-policy correction of rollouts whose behaviour log-probs differ from the trainer's (a
    dedicated engine, async RL, `sync.every` > 1). Logged every iteration: `train/is_weight_*`,
    `train/is_truncated_frac`, `train/is_masked_frac`, `train/behaviour_logp_abs_diff`,
    `train/stale_frac`."""

    objective: Literal["decoupled", "behaviour"] = Field(
        "decoupled", description="decoupled: PPO ratio against the proximal policy (the trainer's replay before the "
        "first step), importance weights proximal/behaviour on the loss; behaviour: PPO ratio against the behaviour "
        "log-probs themselves, no importance weight (only `mode: mask` applies).")
    level: Literal["token", "sequence"] = Field(
        "token", description="token: one weight per token exp(o_t - b_t); sequence: exp(sum_t (o_t - b_t)) per sample.")
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: w = min(w, cap) (truncated IS); mask: w kept inside `band`, 0 outside "
        "(those tokens or samples are dropped).")
    cap: float = Field(2.0, gt=1, description="C: the truncation cap, and the band [1/C, C] when `band` is empty.")
    band: tuple[float, float] | None = Field(
        None, description="mode mask: [lo, hi] of importance weights that are kept (empty: [1/cap, cap]).")

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.band is not None and not 0 <= self.band[0] < 1 < self.band[1]:
            raise ValueError(f"rollout.correction.band: need 0 <= lo < 1 < hi, got {list(self.band)}")
        if self.objective == "behaviour" and self.mode == "truncate":
            raise ValueError("rollout.correction.mode: truncated importance sampling corrects from the behaviour to the "
                             "proximal policy, which `objective: behaviour` does not use; set `mode: mask` or "
                             "`objective: decoupled`")
        return self

    @property
    def limits(self) -> tuple[float, float]:
        """The band of kept weights in mask mode."""
        return self.band if self.band is not None else (1.0 / self.cap, self.cap)


"""The error of a replay that is not what was sampled: raised by the behaviour check
(stages/kernels/behaviour.py), caught and named by the run; here so that naming it loads no torch."""
from __future__ import annotations

from typing import Any


class BehaviourMismatchError(RuntimeError):
    """The trainer's replay of sampled data differs from the behaviour log-probs recorded at
    sampling time by more than the tolerance: sampling and training did not see the same policy."""


def mismatch_error(ctx: Any, sample_id: str, what: str, largest: float, limit: float) -> BehaviourMismatchError:
    return BehaviourMismatchError(
        f"iteration {ctx.iteration}, rank {ctx.rank}: sample {sample_id!r}: the trainer's replay of {what} "
        f"differs from the log-probs recorded at sampling time by {largest:.3g} (tolerance {ctx.tolerance:.3g}"
        + (f", masked up to {limit:.3g}" if limit > ctx.tolerance else "") + "); "
        "sampling and training must see the same weights, inputs and positions (rollout.behaviour_tolerance "
        "raises the tolerance for an engine with other kernels)"
    )

"""The algorithm seam: one registered class per algorithm, next to its loss kernel.

    @algorithms.register("grpo")
    class GRPO(TokenPolicyGradient):
        config = GRPOConfig            # the recipe's `algorithm:` section, `name: Literal["grpo"]`

An algorithm declares the segment kind it trains ("text", "latent"), whether it supports several
updates per batch, whether rollouts sample with the EMA weights, which recorded fields it
anchors on, and whether it needs a reference policy. It implements "freeze the old policy once"
(`freeze_old`, before the batch's first optimizer step) and "loss + backward for a micro-batch"
(`loss_backward`). The update loop (stages/train/update.py) owns everything else.

Behaviour policy. The log-probs recorded at sampling time are the behaviour policy; the trainer's
replay before the batch's first step (the proximal policy) is compared with them by
`check_behaviour`, on three levels (docs/extending.md, "The behaviour check"): within the
tolerance a token trains; above it, up to the mask limit, it is masked out of the loss and counted
(`train/behaviour_masked_frac`); above the mask limit, or on more than `max_masked_frac` of the
samples a rank checks in an update, the update fails loud, naming the iteration and the sample.
The largest difference is reported as `train/behaviour_logp_max_abs_diff`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import Registry

algorithms: Registry[type[Algorithm]] = Registry("algorithm", "unirl.stages.algorithms", "algorithm.name")


class BehaviourMismatchError(RuntimeError):
    """The trainer's replay of sampled data differs from the behaviour log-probs recorded at
    sampling time by more than the tolerance: sampling and training did not see the same policy."""


@dataclass
class TrainContext:
    """What an algorithm sees of the update: the policy (replay), the train stack (the module,
    the reference), the iteration, the run seed and the behaviour tolerance; `version`: the policy
    version the trainer holds before the update (None: `iteration`, as without rollout
    accumulation, where iteration k trains version k)."""

    policy: Any
    stack: Any
    iteration: int
    seed: int
    tolerance: float
    rank: int = 0
    version: int | None = None
    # Above `tolerance` and at most `mask_limit` a replayed element is masked out of the loss (None:
    # no such band, today's strict check); more than `max_masked_frac` of the samples checked in an
    # update masked fails it.
    mask_limit: float | None = None
    max_masked_frac: float = 0.0
    checked: set[str] = field(default_factory=set)  # sample ids checked in this update, on this rank
    masked: dict[str, float] = field(default_factory=dict)  # masked sample id -> its largest difference

    @property
    def trained_version(self) -> int:
        """The version whose own samples must replay to their record (the on-policy check)."""
        return self.iteration if self.version is None else self.version

    @property
    def module(self) -> Any:
        return self.stack.module

    @property
    def world(self) -> int:
        return self.stack.world

    def reference(self) -> Any:
        return self.stack.reference()

    def teacher(self, name: str) -> Any:
        """The frozen teacher `name` of on-policy distillation, sharded as the module is."""
        return self.stack.teacher(name)


def behaviour_mismatch(replayed: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |replayed - recorded| over the mask: the behaviour-vs-trainer mismatch, measured
    without judging it (rows of older policy versions are expected to differ)."""
    diff = torch.where(mask > 0, (replayed.detach().float() - recorded.float()).abs(), torch.zeros_like(mask))
    return float(diff.max()) if diff.numel() else 0.0, float(diff.sum()) / max(float(mask.sum()), 1.0)


def mismatch_error(ctx: TrainContext, sample_id: str, what: str, largest: float, limit: float) -> BehaviourMismatchError:
    return BehaviourMismatchError(
        f"iteration {ctx.iteration}, rank {ctx.rank}: sample {sample_id!r}: the trainer's replay of {what} "
        f"differs from the log-probs recorded at sampling time by {largest:.3g} (tolerance {ctx.tolerance:.3g}"
        + (f", masked up to {limit:.3g}" if limit > ctx.tolerance else "") + "); "
        "sampling and training must see the same weights, inputs and positions (rollout.behaviour_tolerance "
        "raises the tolerance for an engine with other kernels)"
    )


def check_behaviour(replayed: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor | None, *, ctx: TrainContext,
                    sample_ids: list[str], what: str, maskable: bool = True) -> tuple[float, float, torch.Tensor]:
    """Compare the trainer's replay with the sampler's record, replayed/recorded (B, ...), mask
    (B, ...) or None (every element). Returns (max, mean |difference| over the mask, keep): keep
    (B, ...) is 0 where an element is masked out of the loss (its difference above `ctx.tolerance`,
    at most `ctx.mask_limit`), 1 elsewhere. Raises BehaviourMismatchError naming the worst sample
    above the mask limit (above the tolerance when not `maskable`, or without a mask band)."""
    diff = (replayed.detach().float() - recorded.float()).abs()
    if mask is not None:
        diff = torch.where(mask > 0, diff, torch.zeros_like(diff))
    per_sample = diff.reshape(diff.shape[0], -1).max(dim=1).values
    worst = int(per_sample.argmax()) if per_sample.numel() else 0
    largest = float(per_sample.max()) if per_sample.numel() else 0.0
    limit = max(ctx.mask_limit, ctx.tolerance) if maskable and ctx.mask_limit is not None else ctx.tolerance
    if not largest <= limit:  # also catches nan
        raise mismatch_error(ctx, sample_ids[worst], what, largest, limit)
    checked = per_sample.new_ones(per_sample.shape, dtype=torch.bool) if mask is None else \
        (mask.reshape(mask.shape[0], -1) > 0).any(dim=1)
    ctx.checked.update(s for s, c in zip(sample_ids, checked.tolist()) if c)
    for i in torch.nonzero(per_sample > ctx.tolerance).flatten().tolist():
        ctx.masked[sample_ids[i]] = max(ctx.masked.get(sample_ids[i], 0.0), float(per_sample[i]))
    keep = (diff <= ctx.tolerance).to(replayed.dtype)
    count = float(mask.sum()) if mask is not None else float(diff.numel())
    return largest, float(diff.sum()) / max(count, 1.0), keep


def judge_masked(ctx: TrainContext) -> None:
    """After an update's checks on this rank: fail when more than `ctx.max_masked_frac` of the
    samples checked were masked (a real misalignment off by a little everywhere, not rounding on a
    few); then forget them for the next update."""
    checked, masked = len(ctx.checked), dict(ctx.masked)
    ctx.checked.clear()
    ctx.masked.clear()
    if not masked or len(masked) <= ctx.max_masked_frac * checked:
        return
    worst = max(masked, key=lambda s: masked[s])
    raise BehaviourMismatchError(
        f"iteration {ctx.iteration}, rank {ctx.rank}: {len(masked)} of {checked} samples ({len(masked) / checked:.0%}) "
        f"replay more than the tolerance {ctx.tolerance:.3g} away from the log-probs recorded at sampling time "
        f"(the most: sample {worst!r}, by {masked[worst]:.3g}); more than rollout.behaviour_max_masked_frac "
        f"({ctx.max_masked_frac:g}) is not rounding: sampling and training must see the same weights, inputs and positions"
    )


class Algorithm:
    name: ClassVar[str]
    config: ClassVar[type[Section]]
    segment: ClassVar[str]
    supports_multi_update: ClassVar[bool] = True
    samples_with_ema: ClassVar[bool] = False
    # Fields of the stored segment the loss anchors on (the behaviour record it replays against).
    anchors: ClassVar[tuple[str, ...]] = ()
    # Whether rollouts must keep every SDE transition (x_i, x_{i+1}) for the loss to replay.
    replays_transitions: ClassVar[bool] = False
    # The off-policy correction levels the loss takes (rollout.correction.level; empty: it trains
    # only on rows the trained weights sampled, so no async RL and no stale engine weights).
    correction_levels: ClassVar[tuple[str, ...]] = ()
    # Whether it trains on-policy distillation (docs/distillation.md): a token loss that takes a
    # per-token advantage (the teacher's signal), or a flow loss that regresses on the teacher.
    distills: ClassVar[bool] = False
    # Whether it trains only on a teacher's signal, so a recipe without `distill` cannot use it.
    needs_teacher: ClassVar[bool] = False

    def __init__(self, cfg: Any, recipe: Any):
        self.cfg, self.recipe = cfg, recipe

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe using this algorithm; ValueError('field.path: ...')."""

    @classmethod
    def sampler_defaults(cls) -> dict[str, Any]:
        """Flow sampler settings this algorithm implies when the recipe leaves them empty."""
        return {}

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the frozen reference policy (a KL term)."""
        return False

    def ema_decay(self, step: int, decay: float) -> float:
        """Decay of the EMA update after optimizer step `step` (the recipe's, by default)."""
        return decay

    def units(self, batch: Any) -> float:
        """What a micro-batch's share of the mini-batch loss is measured in (samples by default)."""
        return float(len(batch.sample_ids))

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        """What the loss needs of the old policy, computed before the first step (no grad)."""
        return None

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        """The loss of one micro-batch times `share` * world, backpropagated, in optimizer step
        `update` of the batch (0: the first, where the behaviour record is checked). `real`: False
        for a stand-in of weight 0 (collectives only).
        Returns metrics (averaged by the update loop with the policy's weights)."""
        raise NotImplementedError


def get_algorithm(name: str) -> type[Algorithm]:
    return algorithms.get(name)

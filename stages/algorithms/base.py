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
`check_behaviour` (stages/kernels/behaviour.py), on three levels (docs/extending.md, "The behaviour check"): within the
tolerance a token trains; above it, up to the mask limit, it is masked out of the loss and counted
(`train/behaviour_masked_frac`); above the mask limit, or on more than `max_masked_frac` of the
samples a rank checks in an update, the update fails loud, naming the iteration and the sample.
The largest difference is reported as `train/behaviour_logp_max_abs_diff`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from unirl.stages.kernels.errors import BehaviourMismatchError
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms


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


def extreme(key: str) -> str | None:
    """How a metric named `key` combines over micro-batches or steps: "min" (`*_min`), "max" (a
    `max` word in it: `ratio_max`, `behaviour_logp_max_abs_diff`), None: a weighted mean."""
    if key.endswith("_min"):
        return "min"
    return "max" if "max" in key.split("_") else None


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

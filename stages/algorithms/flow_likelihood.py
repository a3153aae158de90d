"""What the likelihood-based flow algorithms (Flow-GRPO and its DanceGRPO / MixGRPO / CPS
variants, Flow-DPPO) share: for each SDE step j of a micro-batch, replay the stored transition
x_j -> x_{j+1} under the current velocity (the policy's `replay`, the sampler's own kernel), take
the algorithm's objective against the log-probs recorded at sampling time, add the optional
`flow_kl` to the reference, and backpropagate that step alone (gradient accumulation across
steps, so one transformer graph is alive at a time). Loss = mean over (samples, SDE steps).

Trainside the first update replays exactly what was sampled (same weights, micro-batch, sigmas and
kernel), so the behaviour tolerance is 0: any difference fails the update.
"""
from __future__ import annotations

from typing import Any, ClassVar

from unirl.stages.algorithms.base import Algorithm, TrainContext, extreme


def add(totals: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    """Fold one step's metrics into the micro-batch's: a mean at `weight`, a max or min as such."""
    for key, value in metrics.items():
        kind = extreme(key)
        if kind is None:
            totals[key] = totals.get(key, 0.0) + float(value) * weight
        else:
            totals[key] = (max if kind == "max" else min)(totals.get(key, float(value)), float(value))


def sde_steps(algorithm: str, batch: Any, iteration: int) -> list[int]:
    """The SDE steps of a micro-batch's trajectories, which the flow losses train at; none is an error."""
    steps: list[int] = batch.plan.sde_indices.tolist()
    if not steps:
        raise ValueError(f"{algorithm} trains at SDE steps, but the rollouts (iteration {iteration}) were sampled with "
                         "no SDE step (rollout.sampler.sde_kind: ode or eta: 0)")
    return steps


class FlowLikelihood(Algorithm):
    segment: ClassVar[str] = "latent"
    anchors: ClassVar[tuple[str, ...]] = ("sde_logprobs",)
    replays_transitions: ClassVar[bool] = True
    # Off-policy correction per SDE step ("token" level: each step's transition is a token here):
    # rows sampled by an older version (async RL, `sync.every` > 1) are reweighted by
    # exp(proximal - behaviour) of each step, or dropped outside the band (stages/kernels/correction.py).
    correction_levels: ClassVar[tuple[str, ...]] = ("token",)
    # Whether the loss reads the old policy's transition means (Flow-DPPO's divergence gate).
    reads_old_means: ClassVar[bool] = False

    @property
    def kl_coef(self) -> float:
        """Weight of `flow_kl` to the reference (0: no reference policy)."""
        return 0.0

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any, weights: Any) -> Any:
        raise NotImplementedError

    @property
    def correction(self) -> Any:
        """The recipe's `rollout.correction` (None: rows are the trained weights' own)."""
        return None if self.recipe is None else self.recipe.rollout.correction

    @property
    def decoupled(self) -> bool:
        """Whether the PPO ratio is taken against the proximal policy (the trainer's replay before
        the batch's first step) rather than the behaviour record: with a decoupled correction."""
        return self.correction is not None and self.correction.objective == "decoupled"

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        """For the later mini-batches, what the loss anchors on, replayed before any step (the
        first mini-batch's is the live replay, detached): each SDE step's proximal log-prob (with a
        decoupled correction) and transition mean (Flow-DPPO)."""
        import torch  # start-up time: torch loads at the first train step

        if update == 0 or not (self.decoupled or self.reads_old_means):
            return None
        with torch.no_grad():
            outs = [ctx.policy.replay(ctx.module, batch, step) for step in batch.plan.sde_indices.tolist()]
        return {"logp": torch.stack([o.log_prob for o in outs], dim=1), "mean": torch.stack([o.mean for o in outs], dim=1)}

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        """Per SDE step j: the replay's log-prob against the anchor, the behaviour log-prob b_j
        recorded at sampling time, or with a decoupled correction the proximal o_j (the live replay
        detached on the first mini-batch, frozen before any step on the later ones) with the
        importance weight exp(o_j - b_j) truncated or masked on that step's loss. Rows the trained
        weights sampled are checked against their record first (trainside: bit for bit); rows of
        older versions are measured only."""
        import torch  # start-up time: torch loads at the first train step

        from unirl.stages.kernels.behaviour import check_behaviour
        from unirl.stages.kernels.correction import importance_weights
        from unirl.stages.kernels.kl import flow_kl

        steps = sde_steps(self.name, batch, ctx.iteration)
        k = len(steps)
        weight = share * ctx.world
        totals: dict[str, float] = {}
        largest, masked = 0.0, 0.0
        fresh = batch.fresh(ctx.trained_version)[:, None]
        correction = self.correction
        for j, step in enumerate(steps):
            out = ctx.policy.replay(ctx.module, batch, step)
            logp = out.log_prob[:, None]
            behaviour = batch.logprobs[:, j:j + 1]
            proximal = logp.detach() if frozen is None else frozen["logp"][:, j:j + 1]
            anchor, adv, weights = behaviour, batch.advantage, None
            step_metrics: dict[str, float] = {}
            if update == 0 and real:
                _, _, keep = check_behaviour(proximal, behaviour, fresh.float(), ctx=ctx, sample_ids=batch.sample_ids,
                                             what=f"SDE step {step}")
                largest = max(largest, float((proximal - behaviour).abs().max()))  # every row's, checked or measured
                masked += float((keep == 0).sum()) / (len(batch.sample_ids) * k)
                if not bool(keep.all()):  # a step a hair off its record: advantage 0 in this step's loss
                    adv = adv * keep[:, 0]
                step_metrics["behaviour_logp_abs_diff"] = float((proximal - behaviour).abs().mean())
            if correction is not None:
                c = correction
                weights, stats = importance_weights(proximal, behaviour, torch.ones_like(behaviour), level="token",
                                                    mode=c.mode, cap=c.cap, band=c.limits)
                if c.objective == "behaviour":
                    weights = (weights > 0).float()  # the anchor stays b; masking drops, nothing reweights
                else:
                    anchor = proximal
                if update == 0 and real:
                    step_metrics.update(stats)
            old_mean = None if frozen is None else frozen["mean"][:, j]
            res = self.step_loss(logp, anchor, adv, out, old_mean, weights)
            loss, metrics = res.loss, {**step_metrics, **res.metrics}
            kl_coef = self.kl_coef
            if kl_coef > 0:
                with torch.no_grad(), ctx.reference() as ref:
                    ref_mean = ctx.policy.replay(ref, batch, step).mean
                kl = flow_kl(out.mean, ref_mean, out.std).mean()
                loss = loss + kl_coef * kl
                metrics["kl"] = float(kl.detach())
            metrics["loss"] = float(loss.detach())
            (loss * (weight / k)).backward()
            add(totals, metrics, 1.0 / k)
        if update == 0 and real:
            totals["behaviour_logp_max_abs_diff"] = largest
            totals["behaviour_masked_frac"] = masked
            totals["stale_frac"] = float(1.0 - fresh.float().mean())
        return totals

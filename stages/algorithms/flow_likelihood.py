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

from unirl.stages.algorithms.base import Algorithm, TrainContext


def add(totals: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    for key, value in metrics.items():
        totals[key] = totals.get(key, 0.0) + float(value) * weight


def sde_steps(algorithm: str, batch: Any, iteration: int) -> list[int]:
    """The SDE steps of a micro-batch's trajectories, which the flow losses train at; none is an error."""
    steps: list[int] = batch.plan.sde_indices.tolist()
    if not steps:
        raise ValueError(f"{algorithm} trains at SDE steps, but the rollouts (iteration {iteration}) were sampled with "
                         "no SDE step (rollout.sampler.sde_kind: ode or eta: 0)")
    return steps


def transition_means(ctx: TrainContext, batch: Any) -> Any:
    """(B, K, *latent) means of every SDE transition of `batch` under the module in place (no grad)."""
    import torch  # start-up time: torch loads at the first train step

    with torch.no_grad():
        return torch.stack([ctx.policy.replay(ctx.module, batch, step).mean for step in batch.plan.sde_indices.tolist()], dim=1)


class FlowLikelihood(Algorithm):
    segment: ClassVar[str] = "latent"
    anchors: ClassVar[tuple[str, ...]] = ("sde_logprobs",)
    replays_transitions: ClassVar[bool] = True

    @property
    def kl_coef(self) -> float:
        """Weight of `flow_kl` to the reference (0: no reference policy)."""
        return 0.0

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def step_loss(self, logp: Any, old: Any, adv: Any, out: Any, old_mean: Any) -> Any:
        raise NotImplementedError

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        import torch  # start-up time: torch loads at the first train step

        from unirl.stages.kernels.behaviour import check_behaviour
        from unirl.stages.kernels.kl import flow_kl

        steps = sde_steps(self.name, batch, ctx.iteration)
        k = len(steps)
        weight = share * ctx.world
        totals: dict[str, float] = {}
        largest, masked = 0.0, 0.0
        for j, step in enumerate(steps):
            out = ctx.policy.replay(ctx.module, batch, step)
            logp = out.log_prob[:, None]
            old = batch.logprobs[:, j:j + 1]
            adv = batch.advantage
            if update == 0 and real:
                diff, _, keep = check_behaviour(logp, old, None, ctx=ctx, sample_ids=batch.sample_ids, what=f"SDE step {step}")
                largest = max(largest, diff)
                masked += float((keep == 0).sum()) / (len(batch.sample_ids) * k)
                if not bool(keep.all()):  # a step a hair off its record: advantage 0 in this step's loss
                    adv = adv * keep[:, 0]
            res = self.step_loss(logp, old, adv, out, None if frozen is None else frozen[:, j])
            loss, metrics = res.loss, dict(res.metrics)
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
        return totals

"""What the token-level policy-gradient algorithms (GRPO, GSPO, DRPO) share: replay the response
under the current policy, anchor on the proximal old log-probs (the trainer's replay before the
batch's first step, checked against the behaviour log-probs recorded at sampling time), the
optional KL to the frozen reference, and backward. Each algorithm supplies only its loss kernel."""
from __future__ import annotations

from typing import Any, ClassVar

from unirl.stages.algorithms.base import Algorithm, TrainContext


class TokenPolicyGradient(Algorithm):
    segment: ClassVar[str] = "text"
    anchors: ClassVar[tuple[str, ...]] = ("response_logprobs",)
    correction_levels: ClassVar[tuple[str, ...]] = ("token", "sequence")

    def loss(self, logp: Any, old_logp: Any, adv: Any, mask: Any, horizon: int) -> Any:
        """The algorithm's loss kernel (stages/kernels/token_losses.py) on one micro-batch: a LossOutput."""
        raise NotImplementedError

    @property
    def sequence_level(self) -> bool:
        """Whether the loss averages over sequences (micro-batches weigh by sequences, not tokens)."""
        return self.cfg.agg != "token_mean"

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def units(self, batch: Any) -> float:
        return float(len(batch.sample_ids)) if self.sequence_level else float(batch.weight)

    def freeze_old(self, ctx: TrainContext, batch: Any, update: int) -> Any:
        """Old log-probs of the later mini-batches, replayed before any step; the first
        mini-batch's are the live replay, detached."""
        return ctx.policy.replay(ctx.module, batch) if update > 0 else None

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        """The loss against the proximal old log-probs o (the live replay, detached, on the first
        mini-batch; frozen before any step on the later ones). With `rollout.correction` the
        behaviour log-probs b recorded at sampling time enter too (stages/algorithms/correction.py):
        importance weights o/b on the advantage, or b as the PPO anchor itself. Rows the trained
        weights sampled are checked against their record first (the on-policy check): a token a
        hair off it (above the tolerance, within the mask limit) gets advantage 0, the whole
        sequence for a sequence-level loss (GSPO); it still counts in the loss's normalisation."""
        import torch  # start-up time: torch loads at the first train step

        from unirl.stages.kernels.behaviour import behaviour_mismatch, check_behaviour, masked_advantage
        from unirl.stages.kernels.correction import importance_weights, weighted_advantage
        from unirl.stages.kernels.kl import kl  # start-up time: it loads torch

        logp = ctx.policy.replay(ctx.module, batch)
        proximal = logp.detach() if frozen is None else frozen
        old_logp, adv = proximal, batch.advantage
        metrics: dict[str, float] = {}
        keep = None
        if real:
            # Rows sampled by the weights being trained must replay to their record (the
            # on-policy check); rows of older versions are expected to differ and are only measured.
            fresh = batch.fresh(ctx.trained_version)  # per token: a partial rollout's tokens have versions of their own
            if bool(fresh.any()):
                _, _, keep = check_behaviour(proximal, batch.behaviour, fresh, ctx=ctx,
                                             sample_ids=batch.sample_ids, what="the response tokens")
            largest, mean = behaviour_mismatch(proximal, batch.behaviour, batch.mask)
            masked = 0.0 if keep is None else float(((1.0 - keep) * batch.mask).sum())
            metrics["behaviour_logp_abs_diff"] = mean
            metrics["behaviour_logp_max_abs_diff"] = largest
            metrics["behaviour_masked_frac"] = masked / max(float(batch.mask.sum()), 1.0)
            metrics["stale_frac"] = float(1.0 - fresh.sum() / batch.mask.sum().clamp(min=1.0))
        correction = self.recipe.rollout.correction
        if correction is not None:
            c = correction
            w, stats = importance_weights(proximal, batch.behaviour, batch.mask, level=c.level, mode=c.mode, cap=c.cap,
                                          band=c.limits)
            if c.objective == "behaviour":
                old_logp, w = batch.behaviour, (w > 0).float()  # the anchor is b; masking drops, nothing reweights
            adv = weighted_advantage(adv, w)
            if real:
                metrics.update(stats)
        if keep is not None and not bool(keep.all()):
            adv = masked_advantage(adv, keep, token_level="token" in self.correction_levels)
        out = self.loss(logp, old_logp, adv, batch.mask, self.recipe.rollout.max_new_tokens)
        loss, metrics = out.loss, {**metrics, **out.metrics}
        cfg = self.cfg
        if cfg.kl_coef > 0:
            with torch.no_grad(), ctx.reference() as ref:
                ref_logp = ctx.policy.replay(ref, batch)
            kl_mean = (kl(logp, ref_logp, cfg.kl_estimator) * batch.mask).sum() / batch.mask.sum()
            loss = loss + cfg.kl_coef * kl_mean
            metrics["kl"] = float(kl_mean.detach())
        (loss * share * ctx.world).backward()
        metrics["loss"] = float(loss.detach())
        return metrics

"""What the token-level policy-gradient algorithms (GRPO, GSPO, DRPO) share: replay the response
under the current policy, anchor on the proximal old log-probs (the trainer's replay before the
batch's first step, checked against the behaviour log-probs recorded at sampling time), the
optional KL to the frozen reference, and backward. Each algorithm supplies only its loss kernel."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from stages.algorithms.aggregate import LossOutput
from stages.algorithms.base import Algorithm, TrainContext, check_behaviour
from stages.algorithms.kl import kl


class TokenPolicyGradient(Algorithm):
    segment: ClassVar[str] = "text"
    anchors: ClassVar[tuple[str, ...]] = ("response_logprobs",)

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, horizon: int) -> LossOutput:
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
        logp = ctx.policy.replay(ctx.module, batch)
        old_logp = logp.detach() if frozen is None else frozen
        out = self.loss(logp, old_logp, batch.advantage, batch.mask, self.recipe.rollout.max_new_tokens)
        loss, metrics = out.loss, dict(out.metrics)
        cfg = self.cfg
        if cfg.kl_coef > 0:
            with torch.no_grad(), ctx.reference() as ref:
                ref_logp = ctx.policy.replay(ref, batch)
            kl_mean = (kl(logp, ref_logp, cfg.kl_estimator) * batch.mask).sum() / batch.mask.sum()
            loss = loss + cfg.kl_coef * kl_mean
            metrics["kl"] = float(kl_mean.detach())
        (loss * share * ctx.world).backward()
        if real:
            largest, mean = check_behaviour(old_logp, batch.behaviour, batch.mask, ctx=ctx, sample_ids=batch.sample_ids,
                                            what="the response tokens")
            metrics["behaviour_logp_abs_diff"] = mean
            metrics["behaviour_logp_max_abs_diff"] = largest
        metrics["loss"] = float(loss.detach())
        return metrics

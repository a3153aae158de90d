"""On-policy distillation of a flow family (docs/distillation.md, "Flow families"): the student
samples its own SDE trajectories; at every stored state x_j of an SDE step the frozen teacher's
velocity is the regression target of the student's. Each row is taught by its domain's teacher
(stages/distill.py `teacher_of`); both velocities take the student's text conditioning.

Symbols: x_j = the student's latent at SDE step j (noise level sigma_j), recorded by the sampler;
v_S = v_theta(x_j, sigma_j), v_T = the teacher's velocity there (no gradient); w = the weight of a
(sample, step): uniform, as our flow-matching SFT weighs its (sample, sigma) draws
(stages/diffusion/sft.py `flow_matching_loss`), times `distill.coef`.
The loss is a regression, not a likelihood ratio, but the run still checks at the first update
that the trainer replays what the sampler did: the log-prob of each stored transition under v_S
against the recorded `sde_logprobs` (tolerance 0 trainside).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from unirl.stages.algorithms.base import Algorithm, TrainContext
from unirl.stages.algorithms.flow_likelihood import sde_steps
from unirl.stages.distill import domain_names, teacher_of
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import algorithms

# Fields of a tiny flow model (model.tiny) that shape only its transformer: a teacher trained with
# `sft` may change them (a bigger teacher); the others fix the latent space or the conditioning.
TRANSFORMER_ONLY = ("num_layers", "num_heads", "head_dim", "patch_size")


class FlowOPDConfig(Section):
    """On-policy distillation of a flow family: the student's velocity regressed on its teacher's at
    the student's own SDE states. The teachers and their routing are the recipe's `distill` section
    (its `coef` weighs the loss)."""

    name: Literal["flow_opd"] = "flow_opd"


def flow_opd_errors(recipe: Any) -> list[str]:
    """What a flow_opd recipe must satisfy beyond `distill_errors` (stages/distill.py)."""
    d = recipe.distill
    if d is None:
        return ["distill: algorithm 'flow_opd' regresses the student on teachers' velocities; add a `distill` section "
                "with its teachers (see recipes/distill/flow.yaml)"]
    errors = []
    if d.mode != "pure":
        errors.append("distill.mode: flow_opd is pure distillation (the teacher's velocity is the whole target; no reward "
                      "enters the loss); set `mode: pure`")
    rows: list[str | None] = [*domain_names(recipe)] or [None]  # a single source's rows have no domain
    untaught = [name for name in rows if teacher_of(recipe, name) is None]
    if untaught:
        errors.append("distill.teacher: flow_opd teaches every row, but rows of "
                      f"{', '.join(repr(u) for u in untaught) if untaught != [None] else 'the single data source'} have "
                      "no teacher; name one in the domain's `teacher` or in distill.teacher")
    warm = getattr(recipe.model, "vae_warmup", None)
    learns_vae = warm is not None and warm.resolved_steps(bool(recipe.model.path)) > 0
    for i, t in enumerate(d.teachers):
        if t.sft is None:
            continue
        if t.init == "base" and learns_vae:
            errors.append(f"distill.teachers.{i}.init: teacher {t.name!r} would start its SFT from the base model and "
                          "learn a VAE of its own (model.vae_warmup), so its velocities would be in another latent space "
                          "than the student's; set `init: student` (its SFT starts from the student's initial weights and "
                          "keeps their VAE)")
        other = sorted(set(t.tiny or {}) - set(TRANSFORMER_ONLY))
        if other:
            errors.append(f"distill.teachers.{i}.tiny: {', '.join(other)} change the teacher's VAE or text encoders, but a "
                          "flow teacher runs on the student's latents and text conditioning; only "
                          f"{', '.join(TRANSFORMER_ONLY)} may differ")
    return errors


@algorithms.register("flow_opd")
class FlowOPD(Algorithm):
    name = "flow_opd"
    config = FlowOPDConfig
    segment: ClassVar[str] = "latent"
    anchors: ClassVar[tuple[str, ...]] = ("sde_logprobs",)
    replays_transitions: ClassVar[bool] = True
    distills: ClassVar[bool] = True
    needs_teacher: ClassVar[bool] = True

    @classmethod
    def check(cls, recipe: Any) -> None:
        errors = flow_opd_errors(recipe)
        if errors:
            raise ValueError("\n".join(errors))

    def routes(self, batch: Any) -> list[tuple[str, list[int]]]:
        """(teacher, its rows of `batch`) for every teacher, in the recipe's order; every teacher
        appears, also with no row (a sharded teacher's forwards are collectives every rank runs)."""
        domains = batch.domains or [None] * len(batch.sample_ids)
        names = [teacher_of(self.recipe, d) for d in domains]
        for sid, d, name in zip(batch.sample_ids, domains, names):
            if name is None and sid != "stand-in":
                raise ValueError(f"sample {sid!r}: domain {d!r} has no distillation teacher; flow_opd teaches every row")
        return [(t.name, [i for i, n in enumerate(names) if n == t.name]) for t in self.recipe.distill.teachers]

    def teacher_velocity(self, ctx: TrainContext, batch: Any, step: int, like: Any) -> Any:
        """(B, *latent) velocity of each row's teacher at the row's stored state of `step` (no grad)."""
        import torch  # start-up time: torch loads at the first train step

        x, sigma = batch.at(step), batch.plan.sigmas[step]
        out = torch.empty_like(like, dtype=torch.float32)
        with torch.no_grad():
            for name, rows in self.routes(batch):
                if not rows and ctx.world == 1:
                    continue
                run = rows or [0]  # a rank with no row of this teacher still runs its forward (collectives)
                v = ctx.policy.velocity(ctx.teacher(name), [batch.prompts[i] for i in run])(x[run], sigma.expand(len(run)))
                if rows:
                    out[rows] = v.float()
        return out

    def loss_backward(self, ctx: TrainContext, batch: Any, frozen: Any, *, share: float, update: int, real: bool) -> dict[str, float]:
        from unirl.stages.kernels.behaviour import check_behaviour  # start-up time: torch loads at the first train step
        from unirl.stages.kernels.flow_losses import flow_opd_loss

        steps = sde_steps(self.name, batch, ctx.iteration)
        k = len(steps)
        weight = share * ctx.world
        totals: dict[str, float] = {}
        largest = 0.0
        for j, step in enumerate(steps):
            v_student = ctx.policy.state_velocity(ctx.module, batch, step)
            if update == 0 and real:  # the on-policy check: this velocity replays the sampler's record
                logp = ctx.policy.replay(ctx.module, batch, step, v=v_student.detach()).log_prob[:, None]
                # No masking: the distillation loss regresses on the teacher and takes no advantage to zero.
                diff, _, _ = check_behaviour(logp, batch.logprobs[:, j:j + 1], None, ctx=ctx, sample_ids=batch.sample_ids,
                                             what=f"SDE step {step}", maskable=False)
                largest = max(largest, diff)
            res = flow_opd_loss(v_student, self.teacher_velocity(ctx, batch, step, v_student), self.recipe.distill.coef)
            (res.loss * (weight / k)).backward()
            for key, value in {**res.metrics, "loss": float(res.loss.detach())}.items():
                totals[key] = totals.get(key, 0.0) + value / k
        if update == 0 and real:
            totals["behaviour_logp_max_abs_diff"] = largest
        return totals

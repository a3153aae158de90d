"""Unified models: one backbone in stages, run in the recipe's order (for stages `plan` then
`image`: it writes a plan for the user's prompt, then draws the plan); every stage's loss goes
into one optimizer step on the same weights (docs/unified.md).

A unified recipe gives `model` (a family that offers each stage's policy, such as
`transfusion`), `train` (the one optimizer and worker group) and `sft` (the joint warm start's
steps, lr and seed); each stage under `compose.stages` gives its name, sampling (with its policy
`kind`), algorithm, warm-start records and loss weight. Each stage is also a one-model recipe
(`stage_recipe`) that its policy, algorithm and prompt source read, as a pipeline part is
(stages/compose/pipeline.py), but there is one run, one worker group and one line of weights
versions:

    iter-N/requests.arrow            the user's prompts, N plans each (the first stage's groups)
    iter-N/rollouts/plan/...         the plans (text segments, behaviour log-probs)   stage generate-plan
    iter-N/requests-image.arrow      one group per plan: M images of it
    iter-N/rollouts/image/...        the images (latent segments)                     stage generate-image
    iter-N/rollouts/composed.arrow   one row per image: its plan and its image, each under its stage's name
    iter-N/rewards.arrow             the image's reward against the user's intent
    iter-N/advantages.arrow          every stage's rows, each within its own groups

Each stage's rollout shards name their stage (schema metadata `unirl.stage`); the worker's train
step reads them by stage (`split_by_stage`), and `joint_update` accumulates every stage's
algorithm's loss into each optimizer step, with the on-policy check of each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from unirl.stages.compose import (
    Shape,
    chain_errors,
    duplicate_errors,
    member,
    members,
    names,
    part_of,
    parts_errors,
    per_part_errors,
    sequential_errors,
    shapes,
    where,
)
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import engines, families, policies
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, join
from unirl.stages.sections import AlgorithmConfig, DataConfig, NamedPart, RolloutConfig, SFTConfig

if TYPE_CHECKING:
    from unirl.stages.recipe import Recipe

class UnifiedStage(NamedPart):
    """One stage of a unified model (stages/compose/unified.py): how it samples, its policy loss, the records
    of its share of the joint warm start and the weight of its loss in the joint step."""

    rollout: RolloutConfig | None = Field(
        None, description="Its sampling, with `kind` (the policy: one the model's family offers). The first stage: "
        "group_size samples per user prompt; each later stage: group_size samples per sample of the stage before it, "
        "one group each (prompts_per_iteration follows from the stages before).")
    algorithm: AlgorithmConfig | None = Field(
        None, description="Its policy loss (one that trains its policy's segment kind); every stage needs one.")
    sft: SFTConfig | None = Field(
        None, description="Its records in the joint warm start (source, path, examples, noise, batch_size per step); the "
        "warm start's steps, lr and seed are the recipe's `sft`. Empty: the stage adds no loss to the warm start.")
    data: DataConfig | None = Field(
        None, description="The prompt source of its warm-start records (empty: the recipe's `data`); an image stage "
        "learns to draw canonical prompts here (data.name: geneval).")
    loss_weight: float = Field(1.0, gt=0, description="Weight of its loss in the joint optimizer step (RL and warm start).")

    @model_validator(mode="before")
    @classmethod
    def _rollout_kind(cls, data: Any) -> Any:
        rollout = data.get("rollout") if isinstance(data, dict) else None
        if isinstance(rollout, dict) and "kind" not in rollout:
            raise ValueError(f"rollout.kind: missing; give stage {data.get('name')!r}'s policy (one the model's family "
                             f"offers: {', '.join(policies.names())})")
        return data


class UnifiedConfig(Section):
    """A unified model: one backbone (a family offering several policies) runs its stages in
    sequence (it writes a plan, then draws it); every stage's loss goes into one optimizer step
    on the shared weights (docs/unified.md)."""

    members_field: ClassVar[str] = "stages"
    replaces: ClassVar[tuple[str, ...]] = ("rollout", "algorithm")  # its stages carry these

    kind: Literal["unified"] = "unified"
    stages: list[UnifiedStage] = Field(min_length=2, max_length=8, description="The stages, in sampling order; every "
                                       "stage but the last writes text (the next stage's prompts).")


@shapes.register("unified")
class Unified(Shape):
    config = UnifiedConfig

    @classmethod
    def errors(cls, recipe: Any) -> list[str]:
        return unified_errors(recipe)

    @classmethod
    def group_stages(cls, recipe: Any) -> dict[str, tuple[Any, float]]:
        return {stage.name: (stage_recipe(recipe, stage.name), stage.loss_weight) for stage in members(recipe)}

    @classmethod
    def sft_data(cls, storage: Any, recipe: Any) -> dict[str, Any]:
        return write_sft_data(storage, recipe)


def sft_records(name: str) -> str:
    """Where stage `name`'s warm-start records are written."""
    return join("sft", f"data-{name}.arrow")


def stage_recipe(recipe: Recipe, name: str) -> Recipe:
    """The one-model recipe of stage `name` (`part_of`): the unified recipe's model, optimizer
    and storage with the stage's sampling, algorithm, data and warm-start records (the recipe's
    `sft` steps, lr and seed). A later stage samples one group per sample of the stage before it;
    only the last stage is scored (the others' reward is what they lead to)."""
    _, stage = member(recipe, name)
    sft = None
    if stage.sft is not None and recipe.sft is not None:
        sft = {**stage.sft.model_dump(mode="json"), "steps": recipe.sft.steps, "lr": recipe.sft.lr, "seed": recipe.sft.seed}
    rollout = stage.rollout.model_dump(mode="json") if stage.rollout is not None else {}
    return part_of(recipe, name, model=recipe.model, rollout=rollout,
                   train=recipe.train, sft=sft, algorithm=stage.algorithm, data=stage.data or recipe.data)


def unified_errors(recipe: Recipe) -> list[str]:
    """What `unirl validate` reports of a unified recipe, one `field.path: ...` line each."""
    stages = members(recipe)
    errors = duplicate_errors(recipe) + per_part_errors(recipe, "a unified recipe")
    family = families.get(recipe.model.kind)
    missing = [s for s in stages if s.rollout is None]
    for stage in missing:
        errors.append(f"{where(recipe, stage.name)}.rollout: missing; give stage {stage.name!r}'s sampling, with its "
                      f"policy `kind` (model.kind {family.name!r} offers {', '.join(family.offers())})")
    if errors:
        return errors
    if len(family.offers()) < 2:
        fits = [n for n, f in families.items() if len(f.offers()) > 1]
        errors.append(f"model.kind: {family.name!r} runs only as a {'/'.join(family.offers())} policy; a unified model "
                      f"runs its stages on one backbone (allowed: {', '.join(fits)})")
    for stage in stages:
        if stage.rollout.kind not in family.offers():
            errors.append(f"{where(recipe, stage.name)}.rollout.kind: model.kind {family.name!r} does not sample with "
                          f"the {stage.rollout.kind} policy (it offers {', '.join(family.offers())})")
        if stage.algorithm is None:
            errors.append(f"{where(recipe, stage.name)}.algorithm: missing; a unified model trains every stage in one "
                          f"step, so give stage {stage.name!r} a policy loss for its {stage.rollout.kind} samples")
        errors += sequential_errors(recipe, stage.name, stage.rollout, "a unified model samples its stages in order with "
                                    "the weights it trains")
        if engines.get(stage.rollout.engine.name).own_weights:
            errors.append(f"{where(recipe, stage.name)}.rollout.engine.name: a unified model samples inside its worker "
                          "group (trainside); dedicated engines serve one policy per model")
    errors += chain_errors(recipe, lambda name: member(recipe, name)[1].rollout.kind)
    if recipe.train.updates_per_batch != 1:
        errors.append("train.updates_per_batch: a unified model takes one joint step per batch; set it to 1")
    if recipe.sft is not None and all(s.sft is None for s in stages):
        errors.append("sft: the joint warm start has no records; give one or more stages an `sft` section")
    if errors:
        return errors
    errors += recipe.scorer_errors(family.produced_by(stages[-1].rollout.kind), f"model.kind {recipe.model.kind!r}")
    return errors + parts_errors(recipe, lambda name: stage_recipe(recipe, name))


def write_sft_data(storage: RunStorage, recipe: Recipe) -> dict[str, Any]:
    """Each stage's warm-start records (its own shard, `sft_records`): a plan stage's (prompt,
    plan) text, an image stage's (canonical prompt, image). `stages` names the stage of each file."""
    from unirl.stages.train.sft import sft_records as records  # at call time: train.sft imports this module while it loads

    files, stages = [], []
    for name in names(recipe):
        part = stage_recipe(recipe, name)
        if part.sft is None:
            continue
        rel = sft_records(name)
        write_shard(storage, rel, table_from_rows(records(part), "sft"))
        files.append(rel)
        stages.append(name)
    return {"files": files, "stages": stages}

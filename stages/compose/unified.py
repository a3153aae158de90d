"""Unified models: one backbone that writes a plan (its text stage, `ar`), then draws it (its image
stage, `diffusion`), both losses in one optimizer step on the same weights (docs/unified.md).

A unified recipe gives `model` (a family that offers the text and the flow policy, such as
`transfusion`), `train` (the one optimizer and worker group) and `sft` (the joint warm start's steps,
lr and seed); each stage gives its sampling, algorithm, warm-start records and loss weight under
`unified.ar` / `unified.diffusion`. Each stage is also a one-model recipe (`stage_recipe`) that its
policy, algorithm and prompt source read, as a pipeline part is (stages/compose/pipeline.py), but there is
one run, one worker group and one line of weights versions:

    iter-N/requests.arrow            the user's prompts, N plans each (the ar group)
    iter-N/rollouts/plans/...        the plans (text segments, behaviour log-probs)   stage generate
    iter-N/image-requests.arrow      one group per plan: M images of it (the flow group)
    iter-N/rollouts/images/...       the images (latent segments)                      stage generate-image
    iter-N/rollouts/composed.arrow   one row per image: its plan and its image, namespaced by kind
    iter-N/rewards.arrow             the image's reward against the user's intent
    iter-N/advantages.arrow          both stages' rows, each within its own groups

The worker's train step reads the plans and the images (`split_by_kind`), and `joint_update`
accumulates the text algorithm's loss and the flow algorithm's into each optimizer step, with
the on-policy check of both.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch

from unirl.stages.compose import POLICY_OF, SIDES, checks, part_of, parts_errors, per_part_errors, segment_of, sequential_errors
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.storage import RunStorage

ROLE = {"ar": "writes the plan", "diffusion": "draws the plan"}
TEXT_RECORDS = "sft/data-ar.arrow"
IMAGE_RECORDS = "sft/data-diffusion.arrow"


def stage_recipe(recipe: Recipe, side: str) -> Recipe:
    """The one-model recipe of a stage (`part_of`): the unified recipe's model, optimizer and
    storage with the stage's sampling, algorithm, data and warm-start records (the recipe's `sft`
    steps, lr and seed). The image stage samples one group per plan; the plan's reward is its
    images'."""
    u = recipe.unified
    assert u is not None
    stage = getattr(u, side)
    rollout = stage.rollout.model_dump(mode="json") if stage.rollout is not None else {"kind": POLICY_OF[side]}
    sft = None
    if stage.sft is not None and recipe.sft is not None:
        sft = {**stage.sft.model_dump(mode="json"), "steps": recipe.sft.steps, "lr": recipe.sft.lr, "seed": recipe.sft.seed}
    return part_of(recipe, side, model=recipe.model, rollout=rollout,
                   upstream=u.ar.rollout if side == "diffusion" else None, train=recipe.train, sft=sft,
                   algorithm=stage.algorithm, data=stage.data or recipe.data, scored=side == "diffusion")


@checks.register("unified")
def unified_errors(recipe: Recipe) -> list[str]:
    """What `unirl validate` reports of a unified recipe, one `field.path: ...` line each."""
    from unirl.stages.algorithms.base import algorithms
    from unirl.stages.engines import engines
    from unirl.stages.models.family import families

    u = recipe.unified
    assert u is not None
    errors = per_part_errors(recipe, ("rollout", "algorithm"), "unified", SIDES, "a unified recipe", "stage")
    family = families.get(recipe.model.kind)
    if set(POLICY_OF.values()) - set(family.offers()):
        fits = [n for n, f in families.items() if set(POLICY_OF.values()) <= set(f.offers())]
        errors.append(f"model.kind: {family.name!r} runs only as a {'/'.join(family.offers())} policy; a unified model "
                      f"writes and draws with one backbone (allowed: {', '.join(fits)})")
    given = [side for side in SIDES if getattr(u, side).algorithm is not None]
    for side in SIDES:
        if getattr(u, side).algorithm is None:
            segment = segment_of(side)
            fits = [n for n, a in algorithms.items() if a.segment == segment]
            other = f"unified.{given[0]}.algorithm is given, but " if given else ""
            errors.append(f"unified.{side}.algorithm: {other}a unified model trains both stages in one step (the "
                          f"{side} stage {ROLE[side]}); give it one of {', '.join(fits)}")
    for side in SIDES:
        rollout = getattr(u, side).rollout
        if rollout is None:
            errors.append(f"unified.{side}.rollout: missing; give the {side} stage's sampling")
            continue
        if rollout.kind != POLICY_OF[side]:
            errors.append(f"unified.{side}.rollout.kind: the {side} stage samples {POLICY_OF[side]}, not {rollout.kind}; "
                          "remove rollout.kind")
        errors += sequential_errors("unified", side, rollout, "a unified model samples its stages in order with the "
                                    "weights it trains")
        if engines.get(rollout.engine.name).own_weights:
            errors.append(f"unified.{side}.rollout.engine.name: a unified model samples inside its worker group "
                          "(trainside); dedicated engines serve one policy per model")
    if recipe.train.updates_per_batch != 1:
        errors.append("train.updates_per_batch: a unified model takes one joint step per batch; set it to 1")
    if recipe.sft is not None and u.ar.sft is None and u.diffusion.sft is None:
        errors.append("sft: the joint warm start has no records; give unified.ar.sft and/or unified.diffusion.sft")
    if errors:
        return errors
    errors += recipe.scorer_errors(family.produces, f"model.kind {recipe.model.kind!r}")
    return errors + parts_errors("unified", SIDES, lambda side: stage_recipe(recipe, side))


def write_sft_data(storage: RunStorage, recipe: Recipe) -> dict[str, Any]:
    """Each stage's warm-start records (its own shard): the ar stage's (prompt, plan) text, the
    diffusion stage's (canonical prompt, image). `stages` names the stage of each file."""
    from unirl.stages.runtime.sample import table_from_rows, write_shard
    from unirl.stages.train.sft import sft_records

    files, stages = [], []
    for side, rel in (("ar", TEXT_RECORDS), ("diffusion", IMAGE_RECORDS)):
        part = stage_recipe(recipe, side)
        if part.sft is None:
            continue
        write_shard(storage, rel, table_from_rows(sft_records(part), "sft"))
        files.append(rel)
        stages.append(side)
    return {"files": files, "stages": stages}


class JointSFT:
    """The joint warm start as one policy to `sft_steps`: each step's loss is the sum of each
    stage's supervised loss (cross-entropy on plans, flow matching on images) times its weight,
    one backward and one optimizer step on the shared weights."""

    weight_name = "samples"

    def __init__(self, stages: dict[str, Any], recipe: Recipe):
        self.stages = stages  # side -> (policy, weight)
        self.recipe = recipe
        self.batch_sizes: dict[str, int] = {}

    def sft_setup(self, tables: dict[str, pa.Table], where: dict[str, str], stack: Any, seed: int) -> dict[str, Any]:
        info: dict[str, Any] = {}
        # The image stage first: a tiny model's VAE is warmed up there, before anything is encoded.
        for side in sorted(tables, key=lambda s: s != "diffusion"):
            policy, _ = self.stages[side]
            info.update(policy.sft_setup(tables[side], where[side], stack, seed))
            part = stage_recipe(self.recipe, side)
            assert part.sft is not None
            self.batch_sizes[side] = part.sft.batch_size
        return info

    def sft_loss(self, module: Any, step: int, *, seed: int, batch_size: int, stack: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum over the stages of weight * loss (each at its own batch size); the value summed over
        ranks likewise."""
        total: Any = 0.0
        value: Any = 0.0
        for side, size in self.batch_sizes.items():
            policy, weight = self.stages[side]
            loss, v = policy.sft_loss(module, step, seed=seed, batch_size=size, stack=stack)
            total = total + weight * loss
            value = value + weight * torch.as_tensor(v, dtype=torch.float64).detach()
        return total, value


def split_by_kind(tables: list[pa.Table]) -> dict[str, pa.Table]:
    """Rollout shards by the stage that wrote them (their `parts`: text -> ar, latent -> diffusion);
    a shard of another kind is an error naming it."""
    side_of = {segment_of(side): side for side in SIDES}
    out: dict[str, list[pa.Table]] = {}
    for table in tables:
        kinds = {tuple(p) for p in table.column("parts").to_pylist()} if table.num_rows else set()
        if not kinds:
            continue
        if len(kinds) != 1 or len(next(iter(kinds))) != 1 or next(iter(kinds))[0] not in side_of:
            raise ValueError(f"a unified train step reads plan (text) and image (latent) shards, not parts {sorted(kinds)}")
        out.setdefault(side_of[next(iter(kinds))[0]], []).append(table)
    return {side: pa.concat_tables(parts, promote_options="default") for side, parts in out.items()}

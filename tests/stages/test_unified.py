"""Unified models: the `transfusion` family offers the text and the flow policy on one set of
weights (saved, loaded by path, sampled with a KV cache and replayed exactly); a unified recipe's
rules; and the joint step's arithmetic (each stage's loss times its weight, one optimizer step)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.conftest import recipe_errors as errors
from unirl.stages.compose.unified import stage_recipe
from unirl.stages.recipe import build_recipe
from unirl.stages.train.stack import OptimizerSpec, TrainStack
from unirl.stages.train.update import UpdatePart, joint_update

TINY = {"image_size": 16, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
        "vae_channels": [8], "text_length": 12}
UNIFIED = {
    "name": "u", "data": {"name": "geneval"}, "reward": {"scorers": [{"name": "brightness"}]},
    "model": {"kind": "transfusion", "tiny": TINY},
    "compose": {"kind": "unified", "stages": [
        {"name": "plan", "rollout": {"kind": "text", "prompts_per_iteration": 2, "group_size": 2, "max_new_tokens": 4},
         "algorithm": {"name": "grpo"}},
        {"name": "image", "rollout": {"kind": "flow", "group_size": 2, "sampler": {"num_steps": 3}}, "algorithm": {"name": "flow_grpo"}}]},
}
PLAN, IMAGE = UNIFIED["compose"]["stages"]  # type: ignore[index]


def unified(*stages: dict) -> dict:
    return {**UNIFIED, "compose": {"kind": "unified", "stages": list(stages)}}


def test_a_unified_recipe_validates_and_each_stage_is_a_one_model_recipe():
    recipe = build_recipe(UNIFIED)
    ar, drawer = stage_recipe(recipe, "plan"), stage_recipe(recipe, "image")
    assert (ar.rollout.kind, ar.algorithm.name, drawer.rollout.kind, drawer.algorithm.name) == ("text", "grpo", "flow", "flow_grpo")
    assert ar.model == drawer.model == recipe.model  # one backbone
    assert drawer.rollout.prompts_per_iteration == 4  # one group per plan: 2 prompts x 2 plans
    assert [s["name"] for s in ar.reward.model_dump()["scorers"]] == ["constant"]  # the plan's reward is its images'
    assert "rollout:" not in recipe.to_yaml().split("compose:")[0]
    three = build_recipe(unified(PLAN, {**PLAN, "name": "refine", "rollout": {"kind": "text", "group_size": 1, "max_new_tokens": 4}},
                                 IMAGE))
    assert [stage_recipe(three, n).rollout.prompts_per_iteration for n in ("plan", "refine", "image")] == [2, 4, 4]


def test_bad_unified_recipes_fail_naming_the_field():
    assert errors(unified(PLAN, {**IMAGE, "algorithm": None})) == [
        "compose.stages.1.algorithm: missing; a unified model trains every stage in one step, so give stage 'image' a "
        "policy loss for its flow samples"]
    no_kind = unified(PLAN, {**IMAGE, "rollout": {"group_size": 2}})
    assert any("rollout.kind: missing; give stage 'image''s policy" in e for e in errors(no_kind))
    wrong_family = {**UNIFIED, "model": {"kind": "sd3", "tiny": {"image_size": 16}}}
    assert "model.kind: 'sd3' runs only as a flow policy; a unified model runs its stages on one backbone (allowed: " \
           "transfusion)" in errors(wrong_family)
    image_first = unified(IMAGE, {**PLAN, "name": "caption"})
    assert any(e.startswith("compose.stages.0: part 'image' samples with the flow policy, whose samples are not text")
               for e in errors(image_first))
    top_level = {**UNIFIED, "algorithm": {"name": "grpo", "clip_low": 0.1}}
    assert any(e.startswith("algorithm: a unified recipe gives it per part (compose.stages.0.algorithm, "
                            "compose.stages.1.algorithm)") for e in errors(top_level))
    wrong_loss = unified({**PLAN, "algorithm": {"name": "nft"}}, IMAGE)
    assert any(e.startswith("compose.stages.0.algorithm.name: 'nft' trains latent segments") for e in errors(wrong_loss))
    asynchronous = unified({**PLAN, "rollout": {"kind": "text", "mode": "async", "max_new_tokens": 4}}, IMAGE)
    assert any(e.startswith("compose.stages.0.rollout.mode: a unified model samples its stages in order") for e in errors(asynchronous))
    lora = {**UNIFIED, "model": {"kind": "transfusion", "tiny": TINY, "lora": {"rank": 4}}}
    assert any("model.lora: the transfusion family trains all its weights" in e for e in errors(lora))


def test_one_set_of_weights_writes_and_draws_and_loads_by_path(tmp_path):
    from unirl.stages.models.family import get_family
    from unirl.stages.policies.flow import FlowPolicy
    from unirl.stages.policies.text import TextPolicy, token_batch, token_logp

    recipe = build_recipe(UNIFIED)
    family = get_family("transfusion")
    assert family.offers() == ("text", "flow")
    folder = family.materialize(recipe.model, tmp_path / "tiny")
    cfg = recipe.model.model_copy(update={"path": str(folder)})  # a real checkpoint's way in: model.path
    bundle = family.load(family.materialize(cfg, tmp_path / "unused"), cfg, torch.device("cpu"))
    text = TextPolicy(family, bundle, stage_recipe(recipe, "plan"), torch.device("cpu"))
    flow = FlowPolicy(family, bundle, stage_recipe(recipe, "image"), torch.device("cpu"))
    rows = text.rollout(bundle.module, [("s/0", "g", "a red circle", {}, None, None), ("s/1", "g", "a cube", {}, None, None)],
                        iteration=0, seed_tag="", greedy=False, stack=None, transitions=False)
    batch = token_batch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], bundle.tokenizer.pad_token_id,
                        torch.device("cpu"))
    replayed = token_logp(bundle.module, batch, 1.0)  # a full forward, right-padded, against the KV-cached sampler
    for i, r in enumerate(rows):
        got = replayed[i][batch["mask"][i] > 0]
        assert torch.allclose(got, torch.tensor(r["response_logprobs"]), atol=1e-5)
    x = torch.randn(1, *family.latent_shape(bundle, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = flow.velocity(bundle.module, ["a red circle"])(x, torch.tensor([0.5]))
    (-replayed.sum()).backward()  # a text loss moves the weights that draw
    with torch.no_grad():
        for p in bundle.module.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    with torch.no_grad():
        after = flow.velocity(bundle.module, ["a red circle"])(x, torch.tensor([0.5]))
    assert not torch.allclose(before, after)


# -- the joint step's arithmetic, with a one-weight model and losses written out --------------


@dataclass
class Batch:
    sample_ids: list[str]
    x: float
    weight: float = 1.0


class Square:
    """Loss (w * x)^2 per sample; its gradient in w is 2 w x^2 per sample."""

    weight_name = "samples"
    samples_with_ema = False

    def template(self, batch, stack):
        return batch

    def stand_in(self, template):
        return Batch([], 0.0, 0.0)

    def units(self, batch):
        return float(len(batch.sample_ids))

    def freeze_old(self, ctx, batch, update):
        return None

    def loss_backward(self, ctx, batch, frozen, *, share, update, real):
        w = ctx.stack.module.weight
        loss = ((w * batch.x) ** 2).sum()
        (loss * share).backward()
        return {"loss": float(loss.detach())}


def test_the_joint_step_sums_each_stage_loss_times_its_weight_in_one_step():
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    stack = TrainStack(type("F", (), {"fsdp_units": staticmethod(lambda m: [])}), type("B", (), {"module": module})(),
                       mesh=None, device=torch.device("cpu"), spec=OptimizerSpec(lr=0.1, max_grad_norm=1e9))
    grads = []
    step = stack.step

    def record() -> float:
        grads.append(float(module.weight.grad))
        return step()

    stack.step = record
    a, b = Square(), Square()
    text = UpdatePart(a, a, [[Batch(["t0", "t1"], 1.0), Batch(["t2"], 2.0)]], [2], 0.0, 1.0, "ar/")
    image = UpdatePart(b, b, [[Batch(["i0"], 3.0)]], [1], 0.0, 0.5, "diffusion/")
    out = joint_update(stack, [text, image], iteration=0, seed=0)
    # mean over the stage's samples of 2 w x^2 (w = 1): ar (2 + 2 + 8) / 3 = 4; diffusion 18; 4 + 0.5 * 18 = 13
    assert grads == [pytest.approx(13.0)] and stack.opt_steps == 1
    # each stage's step loss: the mean over its samples of x^2, whatever its micro-batches: ar (1 + 1 + 4) / 3, diffusion 9
    assert out["ar/loss"] == pytest.approx(2.0) and out["diffusion/loss"] == pytest.approx(9.0)

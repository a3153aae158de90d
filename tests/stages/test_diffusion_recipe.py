"""The diffusion recipe sections: the shipped recipes validate, and bad input is an error that
names the field when the recipe is validated, before any model is loaded."""
from __future__ import annotations

from pathlib import Path

import pytest

from unirl.stages.algorithms.nft import NFTConfig
from unirl.stages.recipe import RecipeError, build_recipe, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "diffusion"


def sd3(**sections):
    data = {"model": {"kind": "sd3"}, "data": {"name": "geneval"}, "algorithm": {"name": "flow_grpo"},
            "reward": {"scorers": [{"name": "geneval"}]}}
    data.update(sections)
    return data


def errors(data) -> str:
    with pytest.raises(RecipeError) as info:
        build_recipe(data)
    return "\n".join(info.value.errors)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate_and_start_with_their_launch_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# unirl ") and str(path.relative_to(RECIPES.parents[1])) in first
    recipe = load_recipe(path)
    assert recipe.rollout.kind == "flow"
    assert recipe.rollout.sampler.sde_kind is not None and recipe.rollout.sampler.sde_steps.mode is not None  # resolved


def test_window_larger_than_the_steps_is_an_error_naming_the_field():
    msg = errors(sd3(rollout={"sampler": {"num_steps": 4, "sde_steps": {"mode": "window", "window_size": 6}}}))
    assert "rollout.sampler.sde_steps.window_size" in msg and "larger than the 4 steps" in msg
    msg = errors(sd3(rollout={"sampler": {"num_steps": 10, "sde_steps": {"mode": "mixgrpo", "window": [0, 0.3],
                                                                          "window_size": 4}}}))
    assert "window_size: 4 is larger than the 3 steps" in msg
    msg = errors(sd3(rollout={"sampler": {"num_steps": 10, "sde_steps": {"mode": "window", "window_size": 3,
                                                                          "num_sde_steps": 5}}}))
    assert "num_sde_steps: 5 is more than the window's 3 steps" in msg


def test_an_image_size_the_vae_cannot_take_is_an_error():
    msg = errors(sd3(model={"kind": "sd3", "tiny": {"image_size": 30}}))
    assert "model.tiny.image_size: image size 30 cannot be taken by the VAE" in msg and "multiple of 4" in msg
    assert "rollout.sampler.image_size: image size 34 cannot be taken" in errors(sd3(rollout={"sampler": {"image_size": 34}}))
    assert "rollout.sampler.image_size: toy GenEval needs images of at least 16 px" in errors(
        sd3(model={"kind": "sd3", "tiny": {"image_size": 8, "patch_size": 2}}))


def test_a_prompt_the_detector_cannot_parse_is_an_error():
    msg = errors(sd3(data={"name": "geneval", "prompts": ["two red circles", "a purple hexagon"]}))
    assert "data.prompts.1: cannot parse toy-GenEval prompt 'a purple hexagon'" in msg


def test_nft_without_ema_is_an_error_and_with_ema_is_fine():
    assert "train.ema: algorithm `nft` samples with and regresses against an EMA old policy" in errors(sd3(algorithm={"name": "nft"}))
    build_recipe(sd3(algorithm={"name": "nft"}, train={"ema": {"decay": 0.9}}))


def test_nft_ema_decay_schedule():
    flat = NFTConfig(ema_flat_steps=2, ema_ramp=0.25)
    assert [flat.ema_decay(k, 0.6) for k in range(6)] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.6]
    assert NFTConfig().ema_decay(0, 0.9) == 0.9


def test_deterministic_sampling_with_one_noise_per_group_is_an_error():
    """eta 0 (or the ODE kernel) and one initial noise per group: every image of a group is the
    same, every advantage 0, and the run would train on nothing."""
    for sampler in ({"eta": 0.0}, {"sde_kind": "ode"}):
        assert "rollout.sampler.init_same_noise: with deterministic sampling" in errors(sd3(rollout={"sampler": sampler}))
        build_recipe(sd3(rollout={"sampler": {**sampler, "init_same_noise": False}}))


def test_flow_grpo_variants_set_their_kernel_and_refuse_a_contradiction():
    assert build_recipe(sd3(algorithm={"name": "dancegrpo"})).rollout.sampler.sde_kind == "dance"
    assert build_recipe(sd3(algorithm={"name": "cps"})).rollout.sampler.sde_kind == "cps"
    mix = build_recipe(sd3(algorithm={"name": "mixgrpo"}, rollout={"sampler": {"sde_steps": {"window_size": 4}}}))
    assert mix.rollout.sampler.sde_steps.mode == "mixgrpo"
    assert build_recipe(sd3()).rollout.sampler.sde_kind == "flow"
    msg = errors(sd3(algorithm={"name": "dancegrpo"}, rollout={"sampler": {"sde_kind": "flow"}}))
    assert "rollout.sampler.sde_kind: algorithm 'dancegrpo' samples with sde_kind='dance', the recipe sets 'flow'" in msg
    # the window rules hold once the algorithm's mode is known
    msg = errors(sd3(algorithm={"name": "mixgrpo"}, rollout={"sampler": {"num_steps": 4, "sde_steps": {"window_size": 6}}}))
    assert "rollout.sampler.sde_steps.window_size: 6 is larger than the 4 steps" in msg

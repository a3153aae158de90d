"""Where unirl's engine server serves (stages/engine_server/__init__.py `engine_device`, the
`rollout.engine.device` of an `engine_server` recipe): `auto` the first GPU where there is one,
else the CPU; a GPU that is not there is an error saying what to set, before any model loads.
Run here on CPU; on a GPU machine `auto` is `cuda:0`."""
from __future__ import annotations

import pytest

from tests.tiny import CASES, merged
from unirl.stages.engine_server import engine_device
from unirl.stages.recipe import RecipeError, build_recipe


def test_auto_is_the_first_gpu_where_there_is_one_else_the_cpu() -> None:
    assert engine_device("auto", 0) == "cpu" and engine_device("auto", 2) == "cuda:0"
    assert engine_device("cpu", 2) == "cpu"
    assert engine_device("cuda", 1) == "cuda:0" and engine_device("cuda:1", 2) == "cuda:1"


def test_a_gpu_that_is_not_there_is_named_with_what_to_set() -> None:
    with pytest.raises(ValueError, match=r"engine device 'cuda:1': torch sees 1 CUDA device\(s\) here; set the engine's "
                                         r"device to cpu or auto"):
        engine_device("cuda:1", 1)
    with pytest.raises(ValueError, match=r"engine device 'cuda': torch sees 0 CUDA device"):
        engine_device("cuda", 0)
    with pytest.raises(ValueError, match=r"engine device 'gpu0': use auto, cpu, cuda or cuda:N"):
        engine_device("gpu0", 1)


def test_the_recipe_names_the_device_and_validate_refuses_another_word() -> None:
    recipe = build_recipe(merged(CASES["qwen3"], {"rollout": {"engine": {"name": "engine_server", "device": "cuda:1"}}}))
    assert recipe.rollout.engine.device == "cuda:1"
    assert build_recipe(merged(CASES["qwen3"], {"rollout": {"engine": {"name": "engine_server"}}})).rollout.engine.device == "auto"
    with pytest.raises(RecipeError, match=r"rollout.engine.device: String should match pattern"):
        build_recipe(merged(CASES["qwen3"], {"rollout": {"engine": {"name": "engine_server", "device": "gpu"}}}))

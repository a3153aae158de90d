"""The canary of verified weight sync (stages/runtime/canary.py) and the `vllm` engine's recipe
rules, checked before anything starts."""
from __future__ import annotations

import math
import re

import pytest

from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.canary import canary_diff, canary_tokens


def test_the_difference_is_the_largest_absolute_one_and_a_broken_answer_is_infinite():
    assert canary_diff([-1.0, -2.0, -0.5], [-1.0, -2.5, -0.25]) == 0.5  # |-2.0 - -2.5| beats |-0.5 - -0.25|
    assert canary_diff([-1.0], [-1.0, -2.0]) == math.inf  # an answer of another length
    assert canary_diff([float("nan")], [-1.0]) == math.inf
    assert canary_diff([], []) == math.inf


def test_the_canary_is_a_fixed_draw_of_ordinary_tokens_within_the_context():
    tokens = canary_tokens(21, {0, 1, 2}, 256)
    assert tokens == canary_tokens(21, {0, 1, 2}, 256) and len(tokens) == 32  # the same for every version
    assert not set(tokens) & {0, 1, 2} and set(tokens) <= set(range(21)) and len(set(tokens)) > 5
    assert len(canary_tokens(21, {0}, 10)) == 9  # a prompt the model's context takes


def vllm_recipe(**over):
    return build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"hidden_size": 64, "num_attention_heads": 2,
                                                                  "num_key_value_heads": 1, "head_dim": 32}},
                                               "rollout": {"engine": {"name": "vllm"}}}, over))


@pytest.mark.parametrize(("over", "message"), [
    ({"model": {"tiny": {"head_dim": 16, "num_attention_heads": 4}}},
     r"model.tiny.head_dim: 16 is not served by vLLM's CPU attention \(32, 64, "),
    ({"rollout": {"top_p": 0.9}}, r"rollout.top_p: 0.9 makes vLLM's log-probs those of the nucleus"),
    ({"rollout": {"engine": {"sync": {"transport": "distributed"}}}}, r"rollout.engine.sync.transport: vllm loads"),
])
def test_recipes_vllm_cannot_serve_are_refused_naming_the_field(over, message):
    with pytest.raises(ValueError, match=message):
        vllm_recipe(**over)


def test_a_flow_model_on_vllm_and_a_vlm_on_engines_without_images_are_refused():
    with pytest.raises(ValueError, match=r"vllm samples language models here; model.kind 'sd3'"):
        build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}, "rollout": {"engine": {"name": "vllm"}}}))
    for engine in ("engine_server", "sglang"):  # their wires carry no images (vllm's does: test_vllm_vision.py)
        with pytest.raises(ValueError, match=rf"{engine} takes prompts without images .* model.kind 'qwen2_5_vl' shows "
                                             r"its prompts' images; sample it trainside"):
            build_recipe(merged(TINY["qwen2_5_vl"], {"rollout": {"engine": {"name": engine, "url": "http://127.0.0.1:1"},
                                                                 "correction": {}}}))


def test_a_servable_recipe_is_accepted():
    recipe = vllm_recipe()
    assert recipe.rollout.engine.name == "vllm" and recipe.rollout.engine.kv_cache_gib == 1


def transport_of(recipe) -> str | None:
    """Why shared-memory staging is refused for the recipe's engine (None: auto picks it)."""
    from unirl.stages.engines.dedicated import DedicatedEngine
    from unirl.stages.runtime.registry import engines

    engine = engines.get(recipe.rollout.engine.name)
    assert issubclass(engine, DedicatedEngine)
    return engine.staging_refused(recipe)


def test_auto_stages_weights_in_shared_memory_only_where_the_engine_can_read_them():
    es = {"rollout": {"engine": {"name": "engine_server"}}}
    assert transport_of(build_recipe(merged(TINY["qwen3"], es))) is None
    assert transport_of(build_recipe(merged(TINY["qwen3"], es, {"model": {"lora": {"rank": 4}},
                                                                 "rollout": {"engine": {"sync": {"weights": "lora"}}}}))) is None
    assert transport_of(vllm_recipe()) is None
    refused = {
        "async": ({"rollout": {"mode": "async", "max_staleness": 1, "correction": {}}}, r"rollout.mode async loads published"),
        "colocated": ({"rollout": {"engine": {"layout": "colocated"}}}, r"which layout colocated releases"),
        "remote": ({"rollout": {"engine": {"url": "http://10.0.0.7:30000"}}}, r"url http://10.0.0.7:30000 is not on loopback"),
    }
    for name, (over, message) in refused.items():
        recipe = build_recipe(merged(TINY["qwen3"], es, over))
        assert recipe.rollout.engine.sync.transport == "auto"
        assert re.search(message, transport_of(recipe) or ""), name
        with pytest.raises(ValueError, match=rf"rollout.engine.sync.transport: shm .*{message}.*; use transport: disk"):
            build_recipe(merged(TINY["qwen3"], es, over, {"rollout": {"engine": {"sync": {"transport": "shm"}}}}))
    flow = merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}}, es)
    assert "model.kind 'sd3'" in transport_of(build_recipe(flow))
    sglang = build_recipe(merged(TINY["qwen3"], {"rollout": {"engine": {"name": "sglang", "url": "http://127.0.0.1:1"},
                                                                       "correction": {}}}))
    assert "is not a transport of sglang" in transport_of(sglang)

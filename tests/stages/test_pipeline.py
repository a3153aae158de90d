"""Prompt-enhancer pipelines without models: the recipe's rules, composed shards (both parts per
row, each readable on its own), and per-part advantages computed by hand."""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from tests.conftest import recipe_errors as errors
from unirl.stages.compose import pipeline
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.sample import ShardSchemaError, part_view, read_rollouts, read_shard, scoring_view, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage

AR: dict[str, Any] = {"model": {"kind": "qwen3", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
                                          "charset": "abcdefghijklmnopqrstuvwxyz "}},
      "rollout": {"prompts_per_iteration": 1, "group_size": 2, "max_new_tokens": 4}, "algorithm": {"name": "grpo"}}
DRAWER: dict[str, Any] = {"model": {"kind": "sd3", "tiny": {"image_size": 16}}, "rollout": {"group_size": 2, "sampler": {"num_steps": 3}},
          "algorithm": {"name": "flow_grpo"}}
PE: dict[str, Any] = {"name": "pe", "data": {"name": "geneval"}, "reward": {"scorers": [{"name": "brightness"}]},
      "pe": {"ar": AR, "diffusion": DRAWER}}


def test_a_pipeline_recipe_validates_and_each_part_is_a_one_model_recipe():
    recipe = build_recipe(PE)
    ar, drawer = (pipeline.part_recipe(recipe, side, "run") for side in pipeline.SIDES)
    assert (ar.model.kind, ar.algorithm.name, drawer.model.kind, drawer.algorithm.name) == ("qwen3", "grpo", "sd3", "flow_grpo")
    assert drawer.rollout.prompts_per_iteration == 2  # one group per rewrite: 1 prompt x 2 rewrites
    assert pipeline.part_storage(recipe, "run", "ar").url().endswith("run/parts/ar")
    assert not pipeline.trains(recipe, "diffusion") and pipeline.trains(recipe, "ar")  # the drawer is frozen by default
    assert "model:" not in recipe.to_yaml().split("pe:")[0]  # the one-model sections a pipeline does not use


def test_bad_pipeline_recipes_fail_naming_the_field():
    flow_rewriter = {**PE, "pe": {**PE["pe"], "ar": {**DRAWER}}}
    assert any(e.startswith("pe.ar.model.kind: 'sd3' is a flow family; the rewriter must be a text family") for e in errors(flow_rewriter))
    frozen = {**PE, "pe": {**PE["pe"], "freeze_llm": True, "freeze_diffusion": True}}
    assert errors(frozen) == ["pe.freeze_llm: both sides are frozen (pe.freeze_diffusion is true too), so nothing trains; "
                              "unfreeze one of them"]
    top_level = {**PE, "model": {"kind": "sd3"}}
    assert any(e.startswith("model: a prompt-enhancer recipe gives it per part") for e in errors(top_level))
    wrong_algorithm = {**PE, "pe": {**PE["pe"], "diffusion": {**DRAWER, "algorithm": {"name": "grpo"}}}}
    assert any(e.startswith("pe.diffusion.algorithm.name: 'grpo' trains text segments") for e in errors(wrong_algorithm))
    def placed(**trains) -> dict:
        return {**PE, "pe": {**PE["pe"], "placement": "shared", "diffusion": {**DRAWER, "train": trains}}}

    assert errors(placed(nproc_per_node=2)) == [  # one group: both parts on the same ranks
        "pe.diffusion.train.nproc_per_node: 2, but pe.ar.train.nproc_per_node is 1; with pe.placement: shared both "
        "parts run on the same ranks, so give both the same value (or set pe.placement: separate)"]
    assert any(e.startswith("pe.diffusion.train.nnodes: pe.placement: shared puts both parts in one worker group on one "
                            "machine") for e in errors(placed(nnodes=2)))
    build_recipe({**PE, "pe": {**PE["pe"], "placement": "separate", "diffusion": {**DRAWER, "train": {"nproc_per_node": 2}}}})
    text_reward = {**PE, "reward": {"scorers": [{"name": "exact_match"}]}}
    assert any("scorer 'exact_match' reads text, but pe.diffusion.model.kind 'sd3' produces image" in e for e in errors(text_reward))


def rewrites() -> list[dict]:
    rows = []
    for j, text in enumerate(["a red circle", "a blue square"]):
        rows.append({"sample_id": f"iter-000000/p0/{j}", "group_id": "iter-000000/p0", "iteration": 0, "policy_version": 0,
                     "parts": ["text"], "metadata": {"geneval_prompt": "a red circle"}, "prompt": "draw a crimson disc",
                     "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "response_logprobs": [-0.1, -0.2, -0.3 - j],
                     "finish_reason": "stop", "text": text})
    return rows


def images() -> list[dict]:
    rows = []
    for j in range(2):
        for k in range(2):
            rows.append({"sample_id": f"iter-000000/p0/{j}/{k}", "group_id": f"iter-000000/p0/{j}", "iteration": 0,
                         "policy_version": 0, "parts": ["latent"], "metadata": {"geneval_prompt": "a red circle"},
                         "prompt": ["a red circle", "a blue square"][j], "sigmas": [1.0, 0.0], "sde_indices": [0],
                         "latents": [float(j), float(k)], "latent_shape": [2], "sde_logprobs": [-1.0 - k],
                         "noise_seed": 10 * j + k, "media_png": bytes([j, k]), "media_frames": None})
    return rows


@pytest.fixture
def composed(tmp_path):
    runs = {side: RunStorage(str(tmp_path / "parts"), side) for side in pipeline.SIDES}
    write_shard(runs["ar"], "iter-000000/rollouts/part-000.arrow", table_from_rows(rewrites(), "rollouts", ["text"]))
    write_shard(runs["diffusion"], "iter-000000/rollouts/part-000.arrow", table_from_rows(images(), "rollouts", ["latent"]))
    storage = RunStorage(str(tmp_path), "run")
    out = pipeline.compose(storage, "iter-000000/rollouts/composed.arrow", runs["ar"], ["iter-000000/rollouts/part-000.arrow"],
                           runs["diffusion"], ["iter-000000/rollouts/part-000.arrow"])
    return storage, out["files"], runs


def test_a_composed_shard_holds_both_parts_per_row_and_each_reads_back_whole(composed):
    storage, files, _ = composed
    plain = ipc.open_file(storage.path(files[0])).read_all()  # plain pyarrow, no unirl
    assert plain.num_rows == 4
    first = plain.slice(2, 1).to_pylist()[0]
    assert first["parts"] == ["text", "latent"] and first["prompt"] == "draw a crimson disc"
    assert (first["text/text"], first["latent/prompt"], first["latent/media_png"]) == ("a blue square", "a blue square", b"\x01\x00")
    assert first["sample_id"] == first["latent/sample_id"] == "iter-000000/p0/1/0" and first["group_id"] == "iter-000000/p0"
    table = read_rollouts(storage, files)
    text = part_view(table, "text")
    assert text.column("sample_id").to_pylist() == ["iter-000000/p0/0", "iter-000000/p0/1"]  # one row per rewrite
    assert [pytest.approx(v) for v in text.column("response_logprobs").to_pylist()] == [r["response_logprobs"] for r in rewrites()]
    latent = part_view(table, "latent")
    assert latent.column("noise_seed").to_pylist() == [0, 1, 10, 11] and latent.column("group_id").to_pylist()[2] == "iter-000000/p0/1"
    scored = scoring_view(table)
    assert scored.column("text").to_pylist() == ["a red circle", "a red circle", "a blue square", "a blue square"]
    assert scored.column("prompt").to_pylist() == ["draw a crimson disc"] * 4  # scored against the user's prompt


def test_a_composed_shard_missing_a_part_column_or_with_wrong_parts_fails_naming_it(composed, tmp_path):
    storage, files, _ = composed
    table = read_rollouts(storage, files)
    broken = table.drop_columns(["latent/sde_logprobs"])
    write_shard(storage, "bad.arrow", broken)
    with pytest.raises(ShardSchemaError, match=r"bad.arrow: column 'latent/sde_logprobs' is missing"):
        read_shard(storage, "bad.arrow", "rollouts")
    wrong = table.set_column(table.schema.get_field_index("parts"), "parts", pa.array([["text"]] * 4, type=pa.list_(pa.string())))
    write_shard(storage, "wrong.arrow", wrong)
    with pytest.raises(ShardSchemaError, match=r"sample 'iter-000000/p0/0/0': column 'parts' is \['text'\]"):
        read_shard(storage, "wrong.arrow", "rollouts")


def test_part_advantages_by_hand(composed):
    storage, files, runs = composed
    recipe = build_recipe({**PE, "pe": {**PE["pe"], "freeze_diffusion": False}})
    rewards = [{"sample_id": s, "group_id": "iter-000000/p0", "reward": r}
               for s, r in zip(["iter-000000/p0/0/0", "iter-000000/p0/0/1", "iter-000000/p0/1/0", "iter-000000/p0/1/1"],
                               [1.0, 0.0, 1.0, 1.0])]
    write_shard(storage, "iter-000000/rewards.arrow", table_from_rows(rewards, "rewards"))
    out = pipeline.part_advantages(recipe, storage, 0, files, ["iter-000000/rewards.arrow"], runs)
    # Rewrite 0's images score 1 and 0 (mean 0.5), rewrite 1's 1 and 1 (mean 1): among the rewrites of
    # the prompt, mean 0.75 and std 0.25, so -1 and +1. Images among their rewrite's: +1, -1; 0, 0.
    ar = read_shard(runs["ar"], out["parts"]["ar"], "advantages").to_pylist()
    assert [(r["sample_id"], r["group_id"]) for r in ar] == [("iter-000000/p0/0", "iter-000000/p0"), ("iter-000000/p0/1", "iter-000000/p0")]
    assert [round(r["advantage"], 4) for r in ar] == [-1.0, 1.0]
    image = read_shard(runs["diffusion"], out["parts"]["diffusion"], "advantages").to_pylist()
    assert [round(r["advantage"], 4) for r in image] == [1.0, -1.0, 0.0, 0.0]
    assert image[0]["group_id"] == "iter-000000/p0/0"
    assert runs["ar"].stage_manifest(0, "advantage")["files"] == [out["parts"]["ar"]]  # what a relaunched group replays

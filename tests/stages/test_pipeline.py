"""Pipelines without models: the recipe's rules, composed shards (every part per row under its
name, each readable on its own), and per-part advantages computed by hand, for two parts and
for three (two text parts, then an image part)."""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from tests.conftest import recipe_errors as errors
from unirl.stages.compose import chain as C
from unirl.stages.compose import pipeline
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.sample import ShardSchemaError, part_view, read_rollouts, read_shard, scoring_view, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage

AR: dict[str, Any] = {"name": "rewriter", "model": {"kind": "qwen3", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
                                          "charset": "abcdefghijklmnopqrstuvwxyz "}},
      "rollout": {"prompts_per_iteration": 1, "group_size": 2, "max_new_tokens": 4}, "algorithm": {"name": "grpo"}}
DRAWER: dict[str, Any] = {"name": "drawer", "model": {"kind": "sd3", "tiny": {"image_size": 16}},
                          "rollout": {"group_size": 2, "sampler": {"num_steps": 3}}, "algorithm": {"name": "flow_grpo"}, "freeze": True}
PE: dict[str, Any] = {"name": "pe", "data": {"name": "geneval"}, "reward": {"scorers": [{"name": "brightness"}]},
      "compose": {"kind": "pipeline", "parts": [AR, DRAWER]}}


def pe(*parts: dict, **compose: Any) -> dict:
    return {**PE, "compose": {"kind": "pipeline", "parts": list(parts or (AR, DRAWER)), **compose}}


def test_a_pipeline_recipe_validates_and_each_part_is_a_one_model_recipe():
    recipe = build_recipe(PE)
    ar, drawer = (pipeline.part_recipe(recipe, name, "run") for name in ("rewriter", "drawer"))
    assert (ar.model.kind, ar.algorithm.name, drawer.model.kind, drawer.algorithm.name) == ("qwen3", "grpo", "sd3", "flow_grpo")
    assert drawer.rollout.prompts_per_iteration == 2  # one group per rewrite: 1 prompt x 2 rewrites
    assert pipeline.part_storage(recipe, "run", "rewriter").url().endswith("run/parts/rewriter")
    assert not pipeline.trains(recipe, "drawer") and pipeline.trains(recipe, "rewriter")
    assert "model:" not in recipe.to_yaml().split("compose:")[0]  # the one-model sections a pipeline does not use
    three = build_recipe(pe(AR, {**AR, "name": "polisher", "rollout": {"group_size": 3, "max_new_tokens": 4}}, DRAWER))
    polisher, drawer = (pipeline.part_recipe(three, name, "run") for name in ("polisher", "drawer"))
    assert (polisher.rollout.prompts_per_iteration, drawer.rollout.prompts_per_iteration) == (2, 6)  # 1 x 2, then x 3
    assert polisher.reward.scorers[0].name == "constant" and drawer.reward.scorers[0].name == "brightness"  # only the last is scored


def test_bad_pipeline_recipes_fail_naming_the_field():
    flow_first = pe(DRAWER, {**AR, "name": "rewriter"})
    assert any(e.startswith("compose.parts.0: part 'drawer' samples with the flow policy, whose samples are not text, so "
                            "part 'rewriter' cannot take them as prompts") for e in errors(flow_first))
    assert errors(pe(AR, {**DRAWER, "freeze": True, "name": "rewriter"})) == [
        "compose.parts.1.name: 'rewriter' is also compose.parts.0's name; give each its own"]
    assert errors(pe(AR, {**DRAWER, "name": "Drawer"}))[0].startswith("compose.parts.1.name: ")
    frozen = pe({**AR, "freeze": True}, DRAWER)
    assert errors(frozen) == ["compose.parts: every part is frozen (rewriter, drawer), so nothing trains; set `freeze: "
                              "false` on one of them"]
    assert errors(pe(AR)) and "at least 2" in errors(pe(AR))[0]
    top_level = {**PE, "model": {"kind": "sd3"}}
    assert any(e.startswith("model: a pipeline recipe gives it per part (compose.parts.0.model, compose.parts.1.model)")
               for e in errors(top_level))
    wrong_algorithm = pe(AR, {**DRAWER, "algorithm": {"name": "grpo"}})
    assert any(e.startswith("compose.parts.1.algorithm.name: 'grpo' trains text segments") for e in errors(wrong_algorithm))

    def placed(**trains) -> dict:
        return pe(AR, {**DRAWER, "train": trains}, placement="shared")

    assert errors(placed(nproc_per_node=2)) == [  # one group: every part on the same ranks
        "compose.parts.1.train.nproc_per_node: 2, but compose.parts.0.train.nproc_per_node is 1; with compose.placement: "
        "shared every part runs on the same ranks, so give all the same value (or set compose.placement: separate)"]
    assert any(e.startswith("compose.parts.1.train.nnodes: compose.placement: shared puts every part in one worker group "
                            "on one machine") for e in errors(placed(nnodes=2)))
    build_recipe(pe(AR, {**DRAWER, "train": {"nproc_per_node": 2}}, placement="separate"))
    former = {k: v for k, v in PE.items() if k != "compose"} | {"pe": {"ar": AR, "diffusion": DRAWER}}  # the old section
    assert errors(former)[0].startswith("pe: replaced by `compose: {kind: pipeline, parts: [...]}`")
    text_reward = {**PE, "reward": {"scorers": [{"name": "exact_match"}]}}
    assert any("scorer 'exact_match' reads text, but compose.parts.1.model.kind 'sd3' produces image" in e
               for e in errors(text_reward))


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


def polished() -> list[dict]:
    """A middle text part: 2 rewrites of each rewrite (the drawer then draws each)."""
    rows = []
    for j in range(2):
        for k in range(2):
            rows.append({**rewrites()[j], "sample_id": f"iter-000000/p0/{j}/{k}", "group_id": f"iter-000000/p0/{j}",
                         "prompt": rewrites()[j]["text"], "text": f"{rewrites()[j]['text']} {'!' * k}".strip()})
    return rows


def write_part(run: RunStorage, rows: list[dict], kind: str) -> list[str]:
    write_shard(run, "iter-000000/rollouts/part-000.arrow", table_from_rows(rows, "rollouts", [kind]))
    return ["iter-000000/rollouts/part-000.arrow"]


@pytest.fixture
def composed(tmp_path):
    runs = {name: RunStorage(str(tmp_path / "parts"), name) for name in ("rewriter", "drawer")}
    chain = [("rewriter", "text", runs["rewriter"], write_part(runs["rewriter"], rewrites(), "text")),
             ("drawer", "latent", runs["drawer"], write_part(runs["drawer"], images(), "latent"))]
    storage = RunStorage(str(tmp_path), "run")
    out = C.compose(storage, "iter-000000/rollouts/composed.arrow", chain)
    return storage, out["files"], runs


def test_a_composed_shard_holds_every_part_per_row_and_each_reads_back_whole(composed):
    storage, files, _ = composed
    plain = ipc.open_file(storage.path(files[0])).read_all()  # plain pyarrow, no unirl
    assert plain.num_rows == 4
    first = plain.slice(2, 1).to_pylist()[0]
    assert first["parts"] == ["rewriter", "drawer"] and first["prompt"] == "draw a crimson disc"
    assert (first["rewriter/text"], first["drawer/prompt"], first["drawer/media_png"]) == ("a blue square", "a blue square", b"\x01\x00")
    assert first["sample_id"] == first["drawer/sample_id"] == "iter-000000/p0/1/0" and first["group_id"] == "iter-000000/p0"
    table = read_rollouts(storage, files)
    text = part_view(table, "rewriter")
    assert text.column("sample_id").to_pylist() == ["iter-000000/p0/0", "iter-000000/p0/1"]  # one row per rewrite
    assert [pytest.approx(v) for v in text.column("response_logprobs").to_pylist()] == [r["response_logprobs"] for r in rewrites()]
    latent = part_view(table, "drawer")
    assert latent.column("noise_seed").to_pylist() == [0, 1, 10, 11] and latent.column("group_id").to_pylist()[2] == "iter-000000/p0/1"
    scored = scoring_view(table)
    assert scored.column("text").to_pylist() == ["a red circle", "a red circle", "a blue square", "a blue square"]
    assert scored.column("prompt").to_pylist() == ["draw a crimson disc"] * 4  # scored against the user's prompt


def test_a_composed_shard_missing_a_part_column_or_with_wrong_parts_fails_naming_it(composed, tmp_path):
    storage, files, _ = composed
    table = read_rollouts(storage, files)
    broken = table.drop_columns(["drawer/sde_logprobs"])
    write_shard(storage, "bad.arrow", broken)
    with pytest.raises(ShardSchemaError, match=r"bad.arrow: column 'drawer/sde_logprobs' is missing"):
        read_shard(storage, "bad.arrow", "rollouts")
    wrong = table.set_column(table.schema.get_field_index("parts"), "parts", pa.array([["rewriter"]] * 4, type=pa.list_(pa.string())))
    write_shard(storage, "wrong.arrow", wrong)
    with pytest.raises(ShardSchemaError, match=r"sample 'iter-000000/p0/0/0': column 'parts' is \['rewriter'\]"):
        read_shard(storage, "wrong.arrow", "rollouts")
    old = table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items() if k != b"unirl.parts"})
    write_shard(storage, "old.arrow", old)
    with pytest.raises(ShardSchemaError, match=r"old.arrow: a composed shard without its parts' kinds"):
        read_shard(storage, "old.arrow", "rollouts")


def rewards_of(storage: RunStorage, values: dict[str, float]) -> list[str]:
    rows = [{"sample_id": s, "group_id": "iter-000000/p0", "reward": r} for s, r in values.items()]
    write_shard(storage, "iter-000000/rewards.arrow", table_from_rows(rows, "rewards"))
    return ["iter-000000/rewards.arrow"]


def test_part_advantages_by_hand(composed):
    storage, files, runs = composed
    recipe = build_recipe(pe(AR, {**DRAWER, "freeze": False}))
    rewards = rewards_of(storage, dict(zip(["iter-000000/p0/0/0", "iter-000000/p0/0/1", "iter-000000/p0/1/0", "iter-000000/p0/1/1"],
                                           [1.0, 0.0, 1.0, 1.0])))
    out = pipeline.part_advantages(recipe, storage, 0, files, rewards, runs)
    # Rewrite 0's images score 1 and 0 (mean 0.5), rewrite 1's 1 and 1 (mean 1): among the rewrites of
    # the prompt, mean 0.75 and std 0.25, so -1 and +1. Images among their rewrite's: +1, -1; 0, 0.
    ar = read_shard(runs["rewriter"], out["parts"]["rewriter"], "advantages").to_pylist()
    assert [(r["sample_id"], r["group_id"]) for r in ar] == [("iter-000000/p0/0", "iter-000000/p0"), ("iter-000000/p0/1", "iter-000000/p0")]
    assert [round(r["advantage"], 4) for r in ar] == [-1.0, 1.0]
    image = read_shard(runs["drawer"], out["parts"]["drawer"], "advantages").to_pylist()
    assert [round(r["advantage"], 4) for r in image] == [1.0, -1.0, 0.0, 0.0]
    assert image[0]["group_id"] == "iter-000000/p0/0"
    assert runs["rewriter"].stage_manifest(0, "advantage")["files"] == [out["parts"]["rewriter"]]  # what a relaunched group replays


def test_three_parts_compose_along_their_lineage_and_each_is_advantaged_among_its_group(tmp_path):
    """rewriter (2 rewrites of the prompt) -> polisher (2 of each rewrite) -> drawer (1 image of
    each): 4 composed rows, each carrying the three samples that led to it."""
    names = ("rewriter", "polisher", "drawer")
    runs = {name: RunStorage(str(tmp_path / "parts"), name) for name in names}
    drawn = [{**images()[0], "sample_id": f"{p['sample_id']}/0", "group_id": p["sample_id"], "prompt": p["text"],
              "noise_seed": i} for i, p in enumerate(polished())]
    chain = [("rewriter", "text", runs["rewriter"], write_part(runs["rewriter"], rewrites(), "text")),
             ("polisher", "text", runs["polisher"], write_part(runs["polisher"], polished(), "text")),
             ("drawer", "latent", runs["drawer"], write_part(runs["drawer"], drawn, "latent"))]
    storage = RunStorage(str(tmp_path), "run")
    files = C.compose(storage, "iter-000000/rollouts/composed.arrow", chain)["files"]
    rows = read_rollouts(storage, files).to_pylist()
    assert [r["parts"] for r in rows] == [list(names)] * 4
    last = rows[3]
    assert (last["sample_id"], last["polisher/sample_id"], last["rewriter/sample_id"]) == (
        "iter-000000/p0/1/1/0", "iter-000000/p0/1/1", "iter-000000/p0/1")
    assert (last["polisher/text"], last["drawer/prompt"], last["group_id"]) == ("a blue square !", "a blue square !", "iter-000000/p0")
    assert scoring_view(read_rollouts(storage, files)).column("text").to_pylist()[3] == "a blue square !"  # the last text part's
    polisher = {**AR, "name": "polisher", "rollout": {"group_size": 2, "max_new_tokens": 4}}
    recipe = build_recipe(pe(AR, polisher, {**DRAWER, "freeze": False, "rollout": {"group_size": 1, "sampler": {"num_steps": 3}}}))
    rewards = rewards_of(storage, {r["sample_id"]: v for r, v in zip(rows, [1.0, 0.0, 1.0, 1.0])})
    adv = C.advantage_rows(recipe, storage, files, rewards, list(names))
    # Polished samples' rewards are their one image's: 1, 0 under rewrite 0 (-> +1, -1), 1, 1 under
    # rewrite 1 (-> 0, 0). Rewrites: the mean of their polished samples', 0.5 and 1 -> -1, +1.
    # Each image is alone in its group (one per polished sample): advantage 0.
    assert [round(r["advantage"], 4) for r in adv["polisher"]] == [1.0, -1.0, 0.0, 0.0]
    assert [r["group_id"] for r in adv["polisher"]] == ["iter-000000/p0/0", "iter-000000/p0/0", "iter-000000/p0/1", "iter-000000/p0/1"]
    assert [round(r["advantage"], 4) for r in adv["rewriter"]] == [-1.0, 1.0]
    assert [r["advantage"] for r in adv["drawer"]] == [0.0] * 4

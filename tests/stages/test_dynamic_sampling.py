"""DAPO dynamic sampling at the advantage stage: all-equal groups dropped, kept up to the target."""
from __future__ import annotations

import pytest

from tests.conftest import TINY
from unirl.stages.recipe import load_recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage


def rewards_file(storage, name, groups):
    rows = [{"sample_id": f"{g}/{j}", "group_id": g, "reward": r} for g, rs in groups.items() for j, r in enumerate(rs)]
    write_shard(storage, name, table_from_rows(rows, "rewards"))
    return name


def test_drop_equal_groups_and_cap(tmp_path):
    recipe = load_recipe(TINY, ["rollout.prompts_per_iteration=2", "rollout.dynamic_sampling={max_rounds: 3}"])
    storage = RunStorage(str(tmp_path), "r")
    first = rewards_file(storage, "iter-000000/rewards.arrow", {"a": [1, 1], "b": [0, 1]})
    second = rewards_file(storage, "iter-000000/rewards-r1.arrow", {"c": [0, 0], "d": [1, 0], "e": [0, 1]})
    out = it.advantages(storage, recipe, 0, [first, second])
    kept = read_shard(storage, out["files"][0], "advantages")
    assert sorted(set(kept.column("group_id").to_pylist())) == ["b", "d"]  # e is past the cap
    assert out["metrics"]["rollout/groups_dropped"] == 2.0
    assert out["metrics"]["rollout/groups_kept"] == 2.0
    assert out["metrics"]["rollout/dynamic_rounds"] == 2.0
    # b: rewards [0, 1] -> z-scores -1, +1 (std 0.5)
    adv = dict(zip(kept.column("sample_id").to_pylist(), kept.column("advantage").to_pylist()))
    assert adv["b/0"] == pytest.approx(-1.0, abs=1e-5) and adv["b/1"] == pytest.approx(1.0, abs=1e-5)


def test_no_signal_after_the_last_round_keeps_zero_advantages(tmp_path):
    recipe = load_recipe(TINY, ["rollout.dynamic_sampling={max_rounds: 1}", "rollout.prompts_per_iteration=1"])
    storage = RunStorage(str(tmp_path), "r")
    only = rewards_file(storage, "iter-000000/rewards.arrow", {"a": [1, 1], "b": [0, 0]})
    out = it.advantages(storage, recipe, 0, [only])
    kept = read_shard(storage, out["files"][0], "advantages")
    assert kept.column("group_id").to_pylist() == ["a", "a"]
    assert kept.column("advantage").to_pylist() == [0.0, 0.0]
    assert out["metrics"]["rollout/groups_kept"] == 0.0


def test_refill_rounds_take_fresh_prompts(tmp_path):
    recipe = load_recipe(TINY, ["rollout.prompts_per_iteration=3", "data.digits=2"])
    storage = RunStorage(str(tmp_path), "r")
    r0 = it.write_requests(storage, recipe, 4, 0)
    r1 = it.write_requests(storage, recipe, 4, 1)
    p0 = read_shard(storage, r0["files"][0], "requests").column("group_id").to_pylist()
    p1 = read_shard(storage, r1["files"][0], "requests").column("group_id").to_pylist()
    assert r1["files"][0].endswith("requests-r1.arrow")
    assert not set(p0) & set(p1)

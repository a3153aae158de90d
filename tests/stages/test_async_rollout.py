"""The staleness bound of async RL: which version samples which iteration, and what the trainer
admits of a batch (whole groups, by the version of every row)."""
from __future__ import annotations

import pytest

from unirl.stages.run.async_rollout import ProducerError, admit, behaviour_version, collect
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage


def rows(versions: dict[str, list[int]]) -> list[dict]:
    return [{"sample_id": f"{g}/{j}", "group_id": g, "iteration": 5, "policy_version": v, "parts": ["text"], "metadata": {},
             "prompt": "p", "prompt_ids": [1], "response_ids": [2], "response_logprobs": [-0.1], "finish_reason": "stop",
             "text": "x"} for g, vs in versions.items() for j, v in enumerate(vs)]


def test_the_schedule():
    assert [behaviour_version(k, 1) for k in range(5)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [behaviour_version(k, 0) for k in range(3)] == [0, 1, 2]
    assert [behaviour_version(k, 1, every=2) for k in range(6)] == [0, 0, 0, 2, 2, 4]


def test_groups_with_a_stale_row_are_dropped_and_counted(tmp_path):
    table = table_from_rows(rows({"a": [4, 4], "b": [4, 3], "c": [5, 5]}), "rollouts", ["text"])
    kept, m = admit(table, version=5, max_staleness=1)
    assert sorted(set(kept.column("group_id").to_pylist())) == ["a", "c"]
    assert m["rollout/stale_groups_dropped"] == 1 and m["rollout/stale_samples_dropped"] == 2
    assert m["rollout/policy_lag_max"] == 2 and m["rollout/policy_lag_mean"] == pytest.approx((1 + 1 + 1 + 2 + 0 + 0) / 6)


def test_collect_admits_a_committed_batch_and_refuses_an_all_stale_one(tmp_path):
    from unirl.stages.recipe import build_recipe

    storage = RunStorage(str(tmp_path), "run")
    recipe = build_recipe({"rollout": {"max_staleness": 1}})
    write_shard(storage, "iter-000005/rollouts/part-000.arrow", table_from_rows(rows({"a": [4, 4], "b": [3, 3]}), "rollouts", ["text"]))
    polls = []
    storage.commit_stage(5, "produce", {"files": ["iter-000005/rollouts/part-000.arrow"], "policy_version": 4})
    out = collect(storage, recipe, 5, alive=lambda: polls.append(1))
    assert out["files"] == ["iter-000005/rollouts/admitted.arrow"] and out["rows"] == 2
    assert out["metrics"]["rollout/stale_groups_dropped"] == 1
    write_shard(storage, "iter-000006/rollouts/part-000.arrow", table_from_rows(rows({"a": [3, 3]}), "rollouts", ["text"]))
    storage.commit_stage(6, "produce", {"files": ["iter-000006/rollouts/part-000.arrow"]})
    with pytest.raises(ProducerError, match="every group of the producer's batch was sampled by a policy older than version 5"):
        collect(storage, recipe, 6, alive=lambda: None)


def test_with_rollout_accumulation_staleness_counts_updates(tmp_path):
    """train.accumulate_rollouts 2: iterations 10 and 11 are trained at version 5 (one update on
    both); with max_staleness 1 the producer samples both with version 4, and the trainer admits
    rows of versions 4 and 5 only."""
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.accumulation import version_of

    recipe = build_recipe({"iterations": 12, "rollout": {"max_staleness": 1}, "train": {"accumulate_rollouts": 2}})
    assert [behaviour_version(version_of(recipe, j), 1) for j in (8, 9, 10, 11)] == [3, 3, 4, 4]
    storage = RunStorage(str(tmp_path), "run")
    write_shard(storage, "iter-000011/rollouts/part-000.arrow",
                table_from_rows(rows({"a": [4, 4], "b": [3, 4]}), "rollouts", ["text"]))
    storage.commit_stage(11, "produce", {"files": ["iter-000011/rollouts/part-000.arrow"], "policy_version": 4})
    out = collect(storage, recipe, 11, alive=lambda: None)
    assert out["rows"] == 2 and out["metrics"]["rollout/stale_groups_dropped"] == 1
    assert out["metrics"]["rollout/policy_lag_max"] == 2  # version 5 trains a row of version 3

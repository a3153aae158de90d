"""Sample shards: Arrow IPC files that round-trip, read zero-copy, and fail naming file and column."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from unirl.stages.runtime.sample import ShardSchemaError, list_column, read_rollouts, read_shard, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage


def rollout_rows(n=3):
    return [
        {"sample_id": f"g0/{j}", "group_id": "g0", "iteration": 0, "policy_version": 0, "parts": ["text"],
         "metadata": {"answer": "3"}, "prompt": "1+2=", "prompt_ids": [5, 6, 7, 8], "response_ids": list(range(j + 1)),
         "response_logprobs": [-0.5] * (j + 1), "finish_reason": "stop", "text": "3"}
        for j in range(n)
    ]


def test_roundtrip_with_plain_pyarrow_and_zero_copy(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    write_shard(s, "iter-000000/rollouts/part-000.arrow", table_from_rows(rollout_rows(), "rollouts", ["text"]))
    plain = ipc.open_file(str(tmp_path / "r/iter-000000/rollouts/part-000.arrow")).read_all()
    assert plain.column("sample_id").to_pylist() == ["g0/0", "g0/1", "g0/2"]
    table = read_shard(s, "iter-000000/rollouts/part-000.arrow", "rollouts")
    values, offsets = list_column(table, "response_ids")
    assert offsets.tolist() == [0, 1, 3, 6]
    assert values.tolist() == [0, 0, 1, 0, 1, 2]
    assert not values.flags.owndata  # a view on the memory-mapped file, not a copy
    assert values.dtype == np.int32


def test_read_rollouts_merges_sorts_and_projects(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    rows = rollout_rows(4)
    write_shard(s, "a.arrow", table_from_rows(rows[2:], "rollouts", ["text"]))
    write_shard(s, "b.arrow", table_from_rows(rows[:2], "rollouts", ["text"]))
    whole = read_rollouts(s, ["a.arrow", "b.arrow"])
    assert whole.column("sample_id").to_pylist() == ["g0/0", "g0/1", "g0/2", "g0/3"]
    some = read_rollouts(s, ["a.arrow", "b.arrow"], columns=["text", "media_png"])  # media_png: not in these
    assert some.schema.names == ["sample_id", "text"] and some.num_rows == 4
    assert some.column("text").to_pylist() == whole.column("text").to_pylist()


def test_corrupted_shard_names_the_file(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    s.write_bytes("iter-000000/rewards.arrow", b"not arrow at all")
    with pytest.raises(ShardSchemaError, match=r"iter-000000/rewards.arrow: not an Arrow IPC file"):
        read_shard(s, "iter-000000/rewards.arrow", "rewards")


def test_missing_or_mistyped_column_names_file_and_column(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    table = pa.table({"sample_id": ["a"], "group_id": ["g"]})
    write_shard(s, "rewards.arrow", table)
    with pytest.raises(ShardSchemaError, match=r"rewards.arrow: column 'reward' is missing"):
        read_shard(s, "rewards.arrow", "rewards")
    write_shard(s, "rewards.arrow", pa.table({"sample_id": ["a"], "group_id": ["g"], "reward": ["high"]}))
    with pytest.raises(ShardSchemaError, match=r"column 'reward' has type string, expected double"):
        read_shard(s, "rewards.arrow", "rewards")


def test_logprobs_must_match_response_length(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    rows = rollout_rows(1)
    rows[0]["response_logprobs"] = [-0.1, -0.2]
    write_shard(s, "p.arrow", table_from_rows(rows, "rollouts", ["text"]))
    with pytest.raises(ShardSchemaError, match=r"sample 'g0/0': column 'response_logprobs' has 2 values for 1"):
        read_shard(s, "p.arrow", "rollouts")


def test_reward_components_are_extra_columns(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    rows = [{"sample_id": "a", "group_id": "g", "reward": 1.0, "reward/exact_match": 1.0}]
    write_shard(s, "rewards.arrow", table_from_rows(rows, "rewards"))
    assert read_shard(s, "rewards.arrow", "rewards").column("reward/exact_match").to_pylist() == [1.0]

"""Run storage: whole-file commits, manifests written last, resume point, on local and memory://."""
from __future__ import annotations

import os

import pytest

from stages.storage import RunStorage


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        return RunStorage(str(tmp_path / "runs"), "r1")
    root = f"memory://unit-{os.getpid()}-{id(request)}"
    return RunStorage(root, "r1")


def test_write_read_and_no_temp_files_left(storage):
    storage.write_json("a/b.json", {"x": 1})
    assert storage.read_json("a/b.json") == {"x": 1}
    assert storage.listdir("a") == ["b.json"]


def test_stage_commit_requires_listed_files(storage):
    with pytest.raises(FileNotFoundError, match="was not written"):
        storage.commit_stage(0, "score", {"files": ["iter-000000/rewards.arrow"]})
    assert storage.stage_manifest(0, "score") is None
    storage.write_bytes("iter-000000/rewards.arrow", b"x")
    storage.commit_stage(0, "score", {"files": ["iter-000000/rewards.arrow"], "rows": 1})
    assert storage.stage_manifest(0, "score")["rows"] == 1


def test_last_success_needs_contiguous_iterations(storage):
    assert storage.last_success() == -1
    storage.mark_success(0, {})
    storage.mark_success(1, {})
    storage.write_json("iter-000002/manifests/generate.json", {"files": []})
    storage.mark_success(3, {})  # a gap: iteration 2 unfinished
    assert storage.last_success() == 1


def test_checkpoints_count_only_when_committed(storage):
    storage.write_json("checkpoints/000002/extra.json", {})
    storage.write_json("checkpoints/000004/extra.json", {})
    storage.write_json("checkpoints/000004/_COMMITTED", {})
    assert storage.checkpoints() == [4]


def test_local_write_is_atomic_rename(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    s.write_bytes("f.bin", b"1" * 10)
    s.write_bytes("f.bin", b"2" * 5)
    assert (tmp_path / "r" / "f.bin").read_bytes() == b"22222"
    assert sorted(os.listdir(tmp_path / "r")) == ["f.bin"]


def test_bad_run_name():
    with pytest.raises(ValueError, match="not a plain run name"):
        RunStorage("/tmp", "a/b")

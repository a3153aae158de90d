"""Weights staged in shared memory for an engine (stages/train/staging.py): the files are
safetensors that the library itself reads back bit for bit, cut into buckets, written over the
previous version in place, read straight into a module's tensors; bad files are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from unirl.stages.train.staging import INDEX, buckets, read_into, stage_tensors


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(64, 32, generator=g),  # 8 KiB
            "a.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),  # 512 B
            "c.bias": torch.randn(32, generator=g),
            "d.count": torch.tensor(7, dtype=torch.int64),
            "e.big": torch.randn(4096, generator=g)}  # 16 KiB: a bucket of its own


def test_buckets_cut_the_sorted_names_at_the_size():
    t = tensors(0)
    assert buckets(t, 8800) == [["a.weight", "b.weight"], ["c.bias", "d.count"], ["e.big"]]
    assert buckets(t, 1) == [[n] for n in sorted(t)]  # every tensor larger than a bucket stands alone
    assert buckets(t, 1 << 30) == [sorted(t)]


def test_staged_files_read_back_bit_for_bit_and_versions_overwrite_in_place(tmp_path):
    folder = tmp_path / "model"
    first = stage_tensors(folder, tensors(0), 8800)
    assert first["files"] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] and first["tensors"] == 5
    index = json.loads((folder / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors(0)) and index["weight_map"]["e.big"] == first["files"][2]
    inode = (folder / first["files"][0]).stat().st_ino
    stage_tensors(folder, tensors(1), 8800)  # the next version: the same layout, other values
    assert (folder / first["files"][0]).stat().st_ino == inode  # overwritten in place, not replaced
    got = {k: v for f in first["files"] for k, v in load_file(str(folder / f)).items()}
    assert set(got) == set(tensors(1)) and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors(1).items())
    stage_tensors(folder, tensors(2), 1 << 30)  # another layout: one file, the old ones removed
    assert sorted(p.name for p in folder.iterdir()) == ["model-00001-of-00001.safetensors", INDEX]
    assert all(torch.equal(load_file(str(folder / "model-00001-of-00001.safetensors"))[k], v) for k, v in tensors(2).items())


def test_read_into_fills_a_modules_tensors_and_refuses_what_does_not_fit(tmp_path):
    folder = tmp_path / "model"
    out = stage_tensors(folder, tensors(3), 8800)
    state = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    state["c.bias"] = torch.zeros(32, dtype=torch.float64)  # another dtype: read, then converted
    pointers = {k: v.data_ptr() for k, v in state.items()}
    assert sum(read_into(folder / f, state) for f in out["files"]) == 5
    assert all(state[k].data_ptr() == pointers[k] for k in state)  # in place
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in tensors(3).items())
    with pytest.raises(ValueError, match=r"model-00003-of-00003.safetensors: tensors the served model does not have: \['e.big'\]"):
        read_into(folder / out["files"][2], {})
    with pytest.raises(ValueError, match=r"e.big has shape \(4096,\), the served model \(8,\)"):
        read_into(folder / out["files"][2], {"e.big": torch.zeros(8)})
    cut = folder / out["files"][2]
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"e.big is cut short"):
        read_into(cut, {"e.big": torch.zeros(4096)})
    (folder / "huge.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"a safetensors header of 1099511627776 bytes \(at most"):
        read_into(folder / "huge.safetensors", {})


def test_a_filesystem_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from collections import namedtuple

    from unirl.stages.train import staging

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: usage(64 << 20, 64 << 20, 20_000))
    with pytest.raises(staging.NoRoom, match=r"model is on a filesystem with 0 MB free, and the weights need 1 MB "
                                             r"\(a container's /dev/shm is 64 MB unless --shm-size"):
        stage_tensors(tmp_path / "model", tensors(0), 8800)
    assert list((tmp_path / "model").iterdir()) == []
    monkeypatch.undo()
    stage_tensors(tmp_path / "model", tensors(0), 8800)  # room: written

"""Sharded loading (stages/train/shards.py): the model built on the meta device and filled shard by
shard from safetensors equals the one loaded whole; what the files lack is named."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from unirl.stages.models.qwen3 import Qwen3, Qwen3ModelConfig, save_tiny_qwen3
from unirl.stages.runtime.config_base import LoraConfig
from unirl.stages.train.shards import checkpoint_key, fill, lora_value
from unirl.stages.train.stack import OptimizerSpec, TrainStack, load_bundle

HERE = Path(__file__).parent
CFG = Qwen3ModelConfig(tiny={"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), CFG.tiny)


def stack_of(bundle, **kw) -> TrainStack:
    return TrainStack(Qwen3, bundle, mesh=None, device=torch.device("cpu"), spec=OptimizerSpec(lr=1e-3), seed=3, **kw)


def test_meta_build_filled_from_the_files_equals_the_whole_load(folder):
    whole = stack_of(load_bundle(Qwen3, folder, CFG, "cpu", sharded=False), lora=LoraConfig(rank=2, alpha=4)).module.state_dict()
    empty = load_bundle(Qwen3, folder, CFG, "cpu", sharded=True)
    assert all(p.is_meta for p in empty.module.parameters())
    filled = stack_of(empty, lora=LoraConfig(rank=2, alpha=4), weights_dir=folder).module.state_dict()
    assert sorted(whole) == sorted(filled)
    for key in whole:
        assert torch.equal(whole[key], filled[key]), key
    adapters = [k for k in filled if ".lora_A." in k]
    assert adapters and all(torch.equal(filled[k], lora_value(k, filled[k].shape, filled[k].dtype, 3)) for k in adapters)


def test_lora_draw_is_peft_default_seeded_by_run_and_name():
    a = lora_value("x.q_proj.lora_A.default.weight", torch.Size([4, 64]), torch.float32, 1)
    assert a.abs().max() <= 1 / math.sqrt(64) and a.abs().max() > 0.9 / math.sqrt(64)
    assert abs(float(a.mean())) < 0.03  # U(-1/8, 1/8) over 256 draws
    assert torch.equal(a, lora_value("x.q_proj.lora_A.default.weight", torch.Size([4, 64]), torch.float32, 1))
    assert not torch.equal(a, lora_value("x.q_proj.lora_A.default.weight", torch.Size([4, 64]), torch.float32, 2))
    assert not torch.equal(a, lora_value("x.k_proj.lora_A.default.weight", torch.Size([4, 64]), torch.float32, 1))
    assert not lora_value("x.q_proj.lora_B.default.weight", torch.Size([64, 4]), torch.float32, 1).any()


def test_peft_names_map_to_the_checkpoint_keys():
    assert checkpoint_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_key("model.norm.weight") == "model.norm.weight"


def test_a_weight_missing_from_the_files_is_named(folder, tmp_path):
    weights = load_file(folder / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, tmp_path / "model.safetensors")
    module = load_bundle(Qwen3, folder, CFG, "cpu", sharded=True).module
    with pytest.raises(ValueError, match=r"1 weights are not in .*model.safetensors: model.norm.weight .*sharded_load: false"):
        fill(module, torch.device("cpu"), [tmp_path / "model.safetensors"], seed=0)


def test_a_weight_of_another_shape_is_named(folder, tmp_path):
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, tmp_path / "model.safetensors")
    module = load_bundle(Qwen3, folder, CFG, "cpu", sharded=True).module
    with pytest.raises(ValueError, match=r"model.safetensors: model.norm.weight has shape \(7,\), the model expects \(32,\)"):
        fill(module, torch.device("cpu"), [tmp_path / "model.safetensors"], seed=0)


def test_mixed_precision_needs_the_worker_group(folder):
    with pytest.raises(ValueError, match="train.mixed_precision needs a worker group"):
        stack_of(load_bundle(Qwen3, folder, CFG, "cpu", sharded=False), mixed_precision="bf16")


@pytest.mark.slow
def test_world_size_two_shards_equal_the_whole_load_tied_and_with_lora(tmp_path):
    """torchrun, gloo, 2 ranks: untied, tied (lm_head stored once, as Qwen3-0.6B ships) and LoRA;
    FSDP2 mixed precision computes in bf16 with fp32 weights and gradients."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "sharded_load_check.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["case"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    for case in ("untied", "tied", "lora"):
        assert rows[case]["meta_built"] and not rows[case]["whole_meta"] and rows[case]["same"], rows[case]
    assert rows["lora"]["adapters"] > 0 and rows["lora"]["adapters_drawn"]
    assert rows["mixed_precision"] == {"case": "mixed_precision", "logits": "torch.bfloat16", "params": ["torch.float32"], "grads": ["torch.float32"]}

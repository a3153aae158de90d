"""Run by tests/stages/test_sharded_load.py under `torchrun --nproc-per-node 2` (gloo): the tiny
Qwen3 (untied, tied embeddings, with LoRA) loaded whole and shard-wise gives the same full state
on every rank; FSDP2 mixed precision computes in bf16 and keeps fp32 weights. Prints one JSON line
per case on rank 0."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return cast("dict[str, torch.Tensor]", get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def main(work: Path) -> None:
    from unirl.stages.models.qwen3 import Qwen3, Qwen3ModelConfig, save_tiny_qwen3
    from unirl.stages.runtime.config_base import LoraConfig
    from unirl.stages.train.shards import lora_value
    from unirl.stages.train.stack import OptimizerSpec, TrainStack, load_bundle

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    device = torch.device("cpu")
    spec = OptimizerSpec(lr=1e-3)
    for case, tied, lora in (("untied", False, None), ("tied", True, None), ("lora", False, LoraConfig(rank=4, alpha=8))):
        cfg = Qwen3ModelConfig(tiny={"hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 80})
        folder = work / case
        if rank == 0:
            save_tiny_qwen3(folder, cfg.tiny)
            if tied:  # what Qwen3-0.6B ships: lm_head shares the embedding, the file stores it once
                from safetensors.torch import load_file, save_file
                config = json.loads((folder / "config.json").read_text())
                config["tie_word_embeddings"] = True
                (folder / "config.json").write_text(json.dumps(config))
                weights = load_file(folder / "model.safetensors")
                weights.pop("lm_head.weight", None)
                save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        dist.barrier()
        states = {}
        for sharded in (False, True):
            bundle = load_bundle(Qwen3, folder, cfg, device, sharded=sharded)
            empty = any(p.is_meta for p in bundle.module.parameters())
            stack = TrainStack(Qwen3, bundle, mesh=mesh, device=device, spec=spec, lora=lora, seed=7, weights_dir=folder)
            states[sharded] = (empty, full_state(stack.module))
        whole, shards = states[False][1], states[True][1]
        same = sorted(whole) == sorted(shards) and all(torch.equal(whole[k], shards[k]) for k in whole)
        adapters = [k for k in shards if ".lora_A." in k or ".lora_B." in k]
        drawn = all(torch.equal(shards[k], lora_value(k, shards[k].shape, shards[k].dtype, 7)) for k in adapters)
        if rank == 0:
            print(json.dumps({"case": case, "meta_built": states[True][0], "whole_meta": states[False][0], "same": same,
                              "keys": len(whole), "adapters": len(adapters), "adapters_drawn": drawn}), flush=True)
    # mixed precision: bf16 compute, fp32 weights and gradients
    cfg = Qwen3ModelConfig(tiny={"hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 80})
    bundle = load_bundle(Qwen3, work / "untied", cfg, device, sharded=True)
    stack = TrainStack(Qwen3, bundle, mesh=mesh, device=device, spec=spec, weights_dir=work / "untied", mixed_precision="bf16")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    logits = stack.module(input_ids=ids).logits
    logits.float().sum().backward()
    grads = {p.grad.dtype for p in stack.trainable if p.grad is not None}
    params = {p.dtype for p in stack.trainable}
    if rank == 0:
        print(json.dumps({"case": "mixed_precision", "logits": str(logits.dtype), "params": sorted(map(str, params)),
                          "grads": sorted(map(str, grads))}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

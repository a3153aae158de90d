"""Writing a trained SD3 policy as a diffusers folder that `stages.models.sd3.load_sd3` (and
diffusers' StableDiffusion3Pipeline) reads: the base folder's text encoders, tokenizers and
scheduler, the worker's VAE (trained during SFT), and the transformer with LoRA folded in."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"


def merge_lora(state: dict[str, torch.Tensor], *, rank: int, alpha: float, adapter: str = "default") -> dict[str, torch.Tensor]:
    """peft-layout transformer weights -> plain ones: W = W_base + (alpha / r) * B @ A for every
    adapted layer (`x.base_layer.weight` + `x.lora_A.<adapter>.weight` + `x.lora_B.<adapter>.weight`
    -> `x.weight`); other keys are kept."""
    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            merged = value.float()
            if leaf == "weight":
                a = state[f"{prefix}.lora_A.{adapter}.weight"].float()
                b = state[f"{prefix}.lora_B.{adapter}.weight"].float()
                merged = merged + scale * (b.flatten(1) @ a.flatten(1)).reshape(merged.shape)
            out[f"{prefix}.{leaf}"] = merged.to(value.dtype)
        else:
            out[key] = value
    return out


def write_sd3_folder(local: Path, *, base_dir: Path, vae: Any, transformer_state: dict[str, torch.Tensor]) -> None:
    """`local` <- a complete SD3 diffusers folder (see module docstring)."""
    from safetensors.torch import save_file

    local.mkdir(parents=True, exist_ok=True)
    index = json.loads((base_dir / "model_index.json").read_text())
    for name, entry in index.items():
        if name in ("transformer", "vae") or not isinstance(entry, list) or entry[0] is None:
            continue
        if (base_dir / name).is_dir():
            shutil.copytree(base_dir / name, local / name, dirs_exist_ok=True)
    shutil.copy2(base_dir / "model_index.json", local / "model_index.json")
    vae.save_pretrained(local / "vae")
    target = local / "transformer"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(base_dir / "transformer" / "config.json", target / "config.json")
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in transformer_state.items()}
    save_file(tensors, str(target / TRANSFORMER_FILE), metadata={"format": "pt"})

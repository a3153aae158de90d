"""Operations on a loaded SD3 bundle: velocity with or without classifier-free guidance, latents
<-> images, LoRA whose disabled state is the reference policy, and writing a trained policy as a
diffusers folder that `stages.models.sd3.load_sd3` (and diffusers' StableDiffusion3Pipeline) reads.
Conventions are in stages/models/sd3.py."""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from stages.models.sd3 import SD3_LORA_TARGETS, TIMESTEP_SCALE, SD3Bundle, check_image_size

TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"


# ---------------------------------------------------------------------------- velocity


def predict_velocity(bundle: SD3Bundle, latents: torch.Tensor, sigma: float | torch.Tensor, embeds: torch.Tensor,
                     pooled: torch.Tensor, *, guidance_scale: float = 1.0, neg_embeds: torch.Tensor | None = None,
                     neg_pooled: torch.Tensor | None = None) -> torch.Tensor:
    """v (B, C, h, w), float32, at latents (B, C, h, w) and noise level sigma (float or (B,)).

    guidance_scale > 1: classifier-free guidance, v = v_uncond + g * (v_cond - v_uncond), with
    uncond and cond in one batched forward of 2B; guidance_scale == 1: one forward, no guidance.
    embeds (B, L, D), pooled (B, P); neg_* may have batch 1 (one negative prompt for all).
    The transformer sees timestep = sigma * TIMESTEP_SCALE. Keeps the autograd graph."""
    if guidance_scale < 1:
        raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")
    b, _, h, w = latents.shape
    p = bundle.patch_size
    max_patches = bundle.transformer.config.pos_embed_max_size
    if h % p or w % p or (max_patches is not None and max(h, w) > p * max_patches):
        raise ValueError(
            f"latents of {h}x{w} do not fit the transformer (patch {p}, at most {max_patches} patches a side)"
        )
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
    sigma = sigma.expand(b) if sigma.ndim == 0 else sigma
    if sigma.shape != (b,):
        raise ValueError(f"sigma must be a float or shape ({b},), got {tuple(sigma.shape)}")
    timestep = sigma * TIMESTEP_SCALE
    dtype = bundle.transformer.dtype
    guided = guidance_scale > 1
    if guided:
        if neg_embeds is None or neg_pooled is None:
            raise ValueError(
                f"guidance_scale={guidance_scale} needs negative embeddings: "
                "encode_prompts(bundle, prompts, negative_prompt='') and pass neg_embeds/neg_pooled"
            )
        x = torch.cat([latents, latents])
        timestep = torch.cat([timestep, timestep])
        embeds = torch.cat([neg_embeds.expand(b, -1, -1), embeds])
        pooled = torch.cat([neg_pooled.expand(b, -1), pooled])
    else:
        x = latents
    out = bundle.transformer(
        hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=embeds.to(dtype),
        pooled_projections=pooled.to(dtype), return_dict=False,
    )[0].float()
    if not guided:
        return out
    uncond, cond = out.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


# ---------------------------------------------------------------------------- VAE


def _vae_shift(bundle: SD3Bundle) -> tuple[float, float]:
    cfg = bundle.vae.config
    return float(cfg.scaling_factor), float(cfg.shift_factor or 0.0)


@torch.no_grad()
def decode_latents(bundle: SD3Bundle, latents: torch.Tensor) -> torch.Tensor:
    """latents (B, C, h, w) -> uint8 images (B, H, W, 3) on the CPU. Undoes encode_images'
    normalisation: x = latents / scaling_factor + shift_factor before the VAE decoder."""
    scale, shift = _vae_shift(bundle)
    f = bundle.vae_scale_factor
    check_image_size(bundle, latents.shape[-2] * f, latents.shape[-1] * f)
    vae = bundle.vae
    x = (latents.float() / scale + shift).to(device=vae.device, dtype=vae.dtype)
    pixels = vae.decode(x, return_dict=False)[0].float().clamp(-1, 1)
    return ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def _as_uint8_batch(images: Any) -> torch.Tensor:
    if isinstance(images, (list, tuple)):
        images = np.stack([np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in images])
    images = torch.as_tensor(np.asarray(images))
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images (B, H, W, 3) or PIL images, got {images.dtype} {tuple(images.shape)}")
    return images


@torch.no_grad()
def encode_images(bundle: SD3Bundle, images: Any, *, sample: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 images (B, H, W, 3) (array, tensor or list of PIL) -> float32 latents (B, C, h, w) =
    (z - shift_factor) * scaling_factor, z the posterior mean (or a sample when `sample`)."""
    pixels = _as_uint8_batch(images)
    check_image_size(bundle, pixels.shape[1], pixels.shape[2])
    vae = bundle.vae
    x = (pixels.permute(0, 3, 1, 2).float() / 127.5 - 1).to(device=vae.device, dtype=vae.dtype)
    dist = vae.encode(x).latent_dist
    z = dist.sample(generator) if sample else dist.mean
    scale, shift = _vae_shift(bundle)
    return (z.float() - shift) * scale


# ---------------------------------------------------------------------------- LoRA


def add_lora(bundle: SD3Bundle, *, rank: int, alpha: float,
             target_modules: tuple[str, ...] | list[str] = SD3_LORA_TARGETS, dropout: float = 0.0,
             adapter_name: str = "default") -> list[str]:
    """Put a peft LoRA adapter (B initialised to zero, so the policy starts equal to the base) on
    the transformer's layers named by `target_modules` (a module matches a target when its
    name is the target or ends with '.' + target). Only adapter weights stay trainable.
    Returns the names of the adapted layers. A target matching no layer raises ValueError."""
    from peft import LoraConfig

    layers = [n for n, m in bundle.transformer.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    hit = lambda name, t: name == t or name.endswith("." + t)  # noqa: E731 - peft's matching rule
    missing = [t for t in targets if not any(hit(n, t) for n in layers)]
    if missing or not targets:
        tails = (n.split(".") for n in layers)
        known = sorted({".".join(t[-3:] if t[-1].isdigit() else t[-2:]) for t in tails})
        raise ValueError(
            f"LoRA target(s) {missing or targets} match no layer of the SD3 transformer in {bundle.directory}; "
            f"its layers end in: {', '.join(known)}"
        )
    bundle.transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, init_lora_weights=True),
        adapter_name=adapter_name,
    )
    for name, param in bundle.transformer.named_parameters():
        param.requires_grad_("lora_" in name)
    return [n for n in layers if any(hit(n, t) for t in targets)]


@contextmanager
def reference_policy(bundle: SD3Bundle) -> Iterator[SD3Bundle]:
    """Inside the block the transformer runs with its LoRA adapters disabled: the base model,
    i.e. the reference policy for KL, without a second copy of the weights. Nests safely."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    lora_layers = [m for m in bundle.transformer.modules() if isinstance(m, BaseTunerLayer)]
    if not lora_layers:
        raise ValueError(
            f"reference_policy needs a LoRA adapter on the transformer of {bundle.directory} (call add_lora); "
            "a fully fine-tuned policy needs a separately loaded reference model"
        )
    if lora_layers[0].disable_adapters:
        yield bundle
        return
    bundle.transformer.disable_adapters()
    try:
        yield bundle
    finally:
        bundle.transformer.enable_adapters()


# ---------------------------------------------------------------------------- export


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

"""Operations on a loaded SD3 bundle: velocity with or without classifier-free guidance, latents
<-> images, LoRA whose disabled state is the reference policy, and writing a trained policy as a
diffusers folder that `unirl.stages.models.sd3.load_sd3` (and diffusers' StableDiffusion3Pipeline) reads.
Each is SD3's entry to the flow-family code every family shares (stages/models/flow_family.py,
flow_vae.py, flow_lora.py, flow_folder.py); conventions are in stages/models/sd3.py."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from unirl.stages.models import flow_lora
from unirl.stages.models.flow_folder import TRANSFORMER_FILE, write_folder
from unirl.stages.models.flow_vae import ShiftScale, as_uint8_media
from unirl.stages.models.sd3 import SD3, SD3_LORA_TARGETS, SD3Bundle, check_image_size

__all__ = ["TRANSFORMER_FILE", "add_lora", "decode_latents", "encode_images", "merge_lora", "predict_velocity",
           "reference_policy", "write_sd3_folder"]

merge_lora = flow_lora.merge_lora


# ---------------------------------------------------------------------------- velocity


def predict_velocity(bundle: SD3Bundle, latents: torch.Tensor, sigma: float | torch.Tensor, embeds: torch.Tensor,
                     pooled: torch.Tensor, *, guidance_scale: float = 1.0, neg_embeds: torch.Tensor | None = None,
                     neg_pooled: torch.Tensor | None = None) -> torch.Tensor:
    """v (B, C, h, w), float32, at latents (B, C, h, w) and noise level sigma (float or (B,)).

    guidance_scale > 1: classifier-free guidance, v = v_uncond + g * (v_cond - v_uncond), with
    uncond and cond in one batched forward of 2B; guidance_scale == 1: one forward, no guidance.
    embeds (B, L, D), pooled (B, P); neg_* may have batch 1 (one negative prompt for all).
    The transformer sees timestep = sigma * TIMESTEP_SCALE. Keeps the autograd graph."""
    _, _, h, w = latents.shape
    p = bundle.patch_size
    max_patches = bundle.transformer.config.pos_embed_max_size
    if h % p or w % p or (max_patches is not None and max(h, w) > p * max_patches):
        raise ValueError(
            f"latents of {h}x{w} do not fit the transformer (patch {p}, at most {max_patches} patches a side)"
        )
    neg = None if neg_embeds is None or neg_pooled is None else (neg_embeds, neg_pooled)
    return SD3.velocity(bundle, bundle.transformer, latents, sigma, (embeds, pooled), guidance_scale, neg)


# ---------------------------------------------------------------------------- VAE


def decode_latents(bundle: SD3Bundle, latents: torch.Tensor) -> torch.Tensor:
    """latents (B, C, h, w) -> uint8 images (B, H, W, 3) on the CPU. Undoes encode_images'
    normalisation: x = latents / scaling_factor + shift_factor before the VAE decoder."""
    f = bundle.vae_scale_factor
    check_image_size(bundle, latents.shape[-2] * f, latents.shape[-1] * f)
    return ShiftScale().decode(bundle.vae, latents)


def encode_images(bundle: SD3Bundle, images: Any, *, sample: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 images (B, H, W, 3) (array, tensor or list of PIL) -> float32 latents (B, C, h, w) =
    (z - shift_factor) * scaling_factor, z the posterior mean (or a sample when `sample`)."""
    pixels = as_uint8_media(images, video=False)
    check_image_size(bundle, pixels.shape[1], pixels.shape[2])
    return ShiftScale().encode(bundle.vae, pixels, video=False, sample=sample, generator=generator)


# ---------------------------------------------------------------------------- LoRA


def add_lora(bundle: SD3Bundle, *, rank: int, alpha: float,
             target_modules: tuple[str, ...] | list[str] = SD3_LORA_TARGETS, dropout: float = 0.0,
             adapter_name: str = "default") -> list[str]:
    """LoRA on the transformer's layers named by `target_modules` (unirl.stages.models.flow_lora.add_lora)."""
    return flow_lora.add_lora([bundle.transformer], rank=rank, alpha=alpha, target_modules=target_modules,
                              what=SD3.lora_what(bundle), dropout=dropout, adapter_name=adapter_name)


@contextmanager
def reference_policy(bundle: SD3Bundle) -> Iterator[SD3Bundle]:
    """Inside the block the transformer runs with its LoRA adapters disabled: the base model,
    i.e. the reference policy for KL, without a second copy of the weights. Nests safely."""
    with flow_lora.reference_policy([bundle.transformer], SD3.lora_what(bundle)):
        yield bundle


# ---------------------------------------------------------------------------- export


def write_sd3_folder(local: Path, *, base_dir: Path, vae: Any, transformer_state: dict[str, torch.Tensor]) -> None:
    """`local` <- a complete SD3 diffusers folder (see module docstring)."""
    write_folder(local, base_dir=base_dir, vae=vae, parts={"transformer": transformer_state})

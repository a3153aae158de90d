"""A tiny SD3 built in code from seeded random weights and saved in diffusers layout, so tests and
smoke runs load it through `unirl.stages.models.sd3.load_sd3` exactly like a real checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from unirl.stages.models.flow_geometry import check_size
from unirl.stages.models.sd3_text import build_text_encoder, build_tiny_tokenizer, tiny_clip_config, tiny_t5_config


def tiny_sd3_config(*, image_size: int = 32, latent_channels: int = 4, vae_channels: tuple[int, ...] = (32, 32),
                    patch_size: int = 2, num_layers: int = 2, num_heads: int = 4, head_dim: int = 16,
                    clip_hidden: int = 32, with_t5: bool = True, max_length: int = 16,
                    vae_mid_attention: bool = True) -> dict[str, Any]:
    """Sub-configs (plain dicts) of a tiny SD3: two CLIPs, an optional T5, VAE, MMDiT, scheduler.
    The VAE downsamples by 2**(len(vae_channels)-1); the position table covers 2x `image_size`.
    `vae_mid_attention`: the VAE's mid-block self-attention (SD3 has it; a tiny VAE trains
    faster without it)."""
    vae_factor = 2 ** (len(vae_channels) - 1)
    check_size("the tiny SD3 config", image_size, vae_factor, patch_size, None)
    clip = tiny_clip_config(hidden_size=clip_hidden, projection_dim=clip_hidden)
    t5 = tiny_t5_config(d_model=2 * clip_hidden) if with_t5 else None
    latent = image_size // vae_factor
    return {
        "tokenizer": {"model_max_length": max_length},
        "text_encoder": clip,
        "text_encoder_2": dict(clip),
        "text_encoder_3": t5,
        "vae": {
            "in_channels": 3, "out_channels": 3, "latent_channels": latent_channels,
            "down_block_types": ["DownEncoderBlock2D"] * len(vae_channels),
            "up_block_types": ["UpDecoderBlock2D"] * len(vae_channels),
            "block_out_channels": list(vae_channels), "layers_per_block": 1, "norm_num_groups": 8,
            "sample_size": image_size, "use_quant_conv": False, "use_post_quant_conv": False,
            "mid_block_add_attention": vae_mid_attention,
            # SD3's own VAE normalisation, so the scale/shift path is the real one.
            "scaling_factor": 1.5305, "shift_factor": 0.0609,
        },
        "transformer": {
            "sample_size": latent, "patch_size": patch_size, "in_channels": latent_channels,
            "out_channels": latent_channels, "num_layers": num_layers, "attention_head_dim": head_dim,
            "num_attention_heads": num_heads, "joint_attention_dim": 2 * clip_hidden,
            "caption_projection_dim": num_heads * head_dim, "pooled_projection_dim": 2 * clip_hidden,
            "pos_embed_max_size": 2 * latent // patch_size,
        },
        "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
    }


def build_tiny_sd3(directory: str | Path, *, seed: int = 0, image_size: int = 32, with_t5: bool = True,
                   **config: Any) -> Path:
    """Build a tiny SD3 from `tiny_sd3_config(image_size=..., with_t5=..., **config)`, every part
    randomly initialised from `seed` (the global RNG is left as it was), and save it in diffusers
    layout under `directory`, which `load_sd3` then reads like a real checkpoint."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    cfg = tiny_sd3_config(image_size=image_size, with_t5=with_t5, **config)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(model_max_length=cfg["tokenizer"]["model_max_length"])
    parts: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        for k, name in enumerate(("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer")):
            if cfg[name] is None:
                continue
            torch.manual_seed(seed * 100 + k)
            if name == "vae":
                parts[name] = AutoencoderKL(**cfg[name])
            elif name == "transformer":
                parts[name] = SD3Transformer2DModel(**cfg[name])
            else:
                parts[name] = build_text_encoder("t5" if name == "text_encoder_3" else "clip", cfg[name], tokenizer)
    for name, model in parts.items():
        model.save_pretrained(root / name)
    FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]).save_pretrained(root / "scheduler")  # type: ignore[attr-defined]
    index: dict[str, Any] = {
        "_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "image_encoder": [None, None], "feature_extractor": [None, None],
    }
    for suffix in ("", "_2", "_3"):
        if cfg["text_encoder" + suffix] is None:
            index["text_encoder" + suffix] = index["tokenizer" + suffix] = [None, None]
            continue
        cls = "T5EncoderModel" if suffix == "_3" else "CLIPTextModelWithProjection"
        index["text_encoder" + suffix] = ["transformers", cls]
        index["tokenizer" + suffix] = ["transformers", "CLIPTokenizer"]
        tokenizer.save_pretrained(root / ("tokenizer" + suffix))
    (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return root

"""The `sd3` family: Stable Diffusion 3 (an MMDiT transformer, a VAE and SD3's text encoders),
loaded from one local diffusers-layout directory (stable-diffusion-3-medium-diffusers, or a tiny
one `unirl.stages.models.sd3_tiny.build_tiny_sd3` writes), run as the flow-matching policy. The operations on a loaded bundle
(velocity, latents <-> images, LoRA, export) are in stages/models/sd3_ops.py.

Conventions (rectified flow, as SD3 is trained):
  x_sigma = (1 - sigma) * x0 + sigma * noise, sigma in [0, 1] (1 = pure noise);
  the transformer predicts v = dx/dsigma = noise - x0, so an Euler step is x + v * (sigma_next - sigma);
  it is called with timestep = sigma * 1000 (the scheduler's num_train_timesteps), not an integer index.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from unirl.stages.models.family import families
from unirl.stages.models.flow_family import FlowFamily, FlowModelBase
from unirl.stages.models.flow_geometry import FlowGeometry, check_image_side
from unirl.stages.models.flow_vae import ShiftScale
from unirl.stages.models.sd3_text import DEFAULT_T5_LENGTH
from unirl.stages.runtime.config_base import Section

TIMESTEP_SCALE = 1000.0
REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer")
OPTIONAL_PAIRS = (("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3"))
# The attention projections of every MMDiT block (image and text streams), as Flow-GRPO targets.
SD3_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)


# ---------------------------------------------------------------------------- recipe section


class TinySD3(Section):
    """Architecture of the seeded random SD3 used when `model.path` is empty."""

    image_size: int = Field(32, ge=8, description="Side of generated images in pixels.")
    seed: int = Field(0, ge=0, description="Seed of the random initialisation.")
    num_layers: int = Field(2, ge=1, description="MMDiT blocks of the transformer.")
    num_heads: int = Field(4, ge=1, description="Attention heads per block.")
    head_dim: int = Field(16, ge=4, description="Width of one attention head.")
    patch_size: int = Field(4, ge=1, description="Transformer patch side, in latent pixels.")
    vae_channels: list[int] = Field(
        [32], min_length=1,
        description="VAE block widths (multiples of 8); the VAE downsamples by 2**(len-1). The default one block "
        "(no downsampling) reconstructs toy-GenEval scenes exactly after a few hundred warm-up steps.",
    )
    latent_channels: int = Field(4, ge=1, description="Channels of the VAE latent.")
    vae_mid_attention: bool = Field(False, description="Self-attention in the VAE's mid block (SD3's VAE has it; slow at full resolution).")
    with_t5: bool = Field(True, description="Build the T5 text encoder too (else SD3's zero rows stand in).")

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @model_validator(mode="after")
    def _check_sizes(self) -> TinySD3:
        bad = [c for c in self.vae_channels if c % 8]
        if bad:
            raise ValueError(f"model.tiny.vae_channels: {bad} are not multiples of 8 (the VAE's GroupNorm has 8 groups)")
        check_image_side("model.tiny.image_size", self.image_size, self.vae_factor, self.patch_size)
        return self

    def build_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `build_tiny_sd3` for this architecture."""
        return {
            "seed": self.seed, "image_size": self.image_size, "with_t5": self.with_t5,
            "num_layers": self.num_layers, "num_heads": self.num_heads, "head_dim": self.head_dim,
            "patch_size": self.patch_size, "vae_channels": tuple(self.vae_channels),
            "latent_channels": self.latent_channels, "vae_mid_attention": self.vae_mid_attention,
        }


class SD3ModelConfig(FlowModelBase):
    """Stable Diffusion 3 architecture (diffusers SD3Transformer2DModel + AutoencoderKL + text encoders)."""

    kind: Literal["sd3"] = "sd3"
    tiny: TinySD3 = Field(default_factory=TinySD3, description="Tiny architecture, used only without `path`.")


# ---------------------------------------------------------------------------- bundle


@dataclass
class SD3Bundle:
    """Everything one SD3 policy needs. `text_encoders`/`tokenizers`: the CLIP pair (L, G) in
    order; `t5_encoder`/`t5_tokenizer` may be None; `max_sequence_length`: T5 tokens per prompt
    (or zero rows standing in for a missing T5)."""

    transformer: Any
    vae: Any
    text_encoders: list[Any]
    tokenizers: list[Any]
    t5_encoder: Any | None
    t5_tokenizer: Any | None
    scheduler: Any | None
    directory: Path
    max_sequence_length: int

    @property
    def module(self) -> Any:
        """What trains: the transformer."""
        return self.transformer

    @module.setter
    def module(self, value: Any) -> None:
        self.transformer = value

    @property
    def device(self) -> Any:
        return self.transformer.device

    @property
    def dtype(self) -> Any:
        return self.transformer.dtype

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def patch_size(self) -> int:
        return int(self.transformer.config.patch_size)

    @property
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    @property
    def default_image_size(self) -> int:
        return int(self.transformer.config.sample_size) * self.vae_scale_factor


# ---------------------------------------------------------------------------- image sizes


def geometry(bundle: SD3Bundle) -> FlowGeometry:
    """Pixels -> latents (the VAE's factor) -> tokens (the patch, up to the position table's side)."""
    return FlowGeometry(channels=bundle.latent_channels, spatial=bundle.vae_scale_factor, patch=bundle.patch_size,
                        max_patches=bundle.transformer.config.pos_embed_max_size, what=f"the SD3 model in {bundle.directory}")


def check_image_size(bundle: SD3Bundle, height: int, width: int | None = None) -> None:
    """Raise ValueError, saying which sizes work, unless the VAE and transformer take H x W."""
    geo = geometry(bundle)
    for side in (height, height if width is None else width):
        geo.check_side(int(side))


def latent_shape(bundle: SD3Bundle, height: int, width: int | None = None) -> tuple[int, int, int]:
    """(C, H / f, W / f) of the latents for an H x W image, f = vae_scale_factor (size checked)."""
    width = height if width is None else width
    check_image_size(bundle, height, width)
    f = bundle.vae_scale_factor
    return bundle.latent_channels, height // f, width // f


# ---------------------------------------------------------------------------- loading


def _listed(index: dict[str, Any], name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def _load(root: Path, name: str, loader: Any, **kwargs: Any) -> Any:
    try:
        return loader(root / name, **kwargs)
    except (OSError, ValueError) as exc:
        raise OSError(f"could not load {name!r} of the SD3 checkpoint {root} from {root / name}: {exc}") from exc


def load_sd3(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             max_sequence_length: int | None = None) -> SD3Bundle:
    """Load an SD3 diffusers directory (model_index.json + transformer/, vae/, text_encoder[_2,_3]/,
    tokenizer[_2,_3]/, scheduler/). Text encoders and VAE are frozen; the transformer keeps
    requires_grad for full fine-tuning (add_lora freezes it). `max_sequence_length`: T5 tokens,
    default min(256, tokenizer_3's max length), or 256 zero rows without T5 (diffusers' rule)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    root = Path(directory)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} is not a diffusers SD3 directory: {index_path} is missing "
            "(expected the stable-diffusion-3-medium-diffusers layout, or one written by build_tiny_sd3)"
        )
    index = json.loads(index_path.read_text())
    wanted = list(REQUIRED)
    for name in REQUIRED:
        if not _listed(index, name):
            raise ValueError(f"{index_path} lists no {name!r}; an SD3 checkpoint needs {', '.join(REQUIRED)}")
    for encoder, tokenizer in OPTIONAL_PAIRS:
        if _listed(index, encoder) != _listed(index, tokenizer):
            raise ValueError(f"{index_path} lists only one of {encoder!r} and {tokenizer!r}; they come in pairs")
        if _listed(index, encoder):
            wanted += [encoder, tokenizer]
    wanted += ["scheduler"] if _listed(index, "scheduler") else []
    for name in wanted:
        if not (root / name).is_dir():
            raise FileNotFoundError(
                f"SD3 checkpoint {root}: model_index.json lists {name!r} but the subfolder {root / name} is missing"
            )

    transformer = _load(root, "transformer", SD3Transformer2DModel.from_pretrained, torch_dtype=dtype)
    vae = _load(root, "vae", AutoencoderKL.from_pretrained, torch_dtype=dtype)
    encoders, tokenizers = [], []
    for suffix in ("", "_2"):
        if "text_encoder" + suffix in wanted:
            clip = CLIPTextModelWithProjection.from_pretrained
            encoders.append(_load(root, "text_encoder" + suffix, clip, dtype=dtype))
            tokenizers.append(_load(root, "tokenizer" + suffix, AutoTokenizer.from_pretrained))
    t5 = t5_tokenizer = None
    if "text_encoder_3" in wanted:
        t5 = _load(root, "text_encoder_3", T5EncoderModel.from_pretrained, dtype=dtype)
        t5_tokenizer = _load(root, "tokenizer_3", AutoTokenizer.from_pretrained)
    scheduler = None
    if "scheduler" in wanted:
        scheduler = _load(root, "scheduler", FlowMatchEulerDiscreteScheduler.from_pretrained)
    if max_sequence_length is None:
        max_sequence_length = DEFAULT_T5_LENGTH
        if t5_tokenizer is not None:
            max_sequence_length = min(DEFAULT_T5_LENGTH, t5_tokenizer.model_max_length)

    for model in [vae, *encoders, *([t5] if t5 is not None else [])]:
        model.requires_grad_(False).eval().to(device)
    transformer.eval().to(device)
    return SD3Bundle(
        transformer, vae, encoders, tokenizers, t5, t5_tokenizer, scheduler, root, int(max_sequence_length)
    )


# ---------------------------------------------------------------------------- the family


def native_image_size(cfg: SD3ModelConfig) -> int:
    """The image side a model of `cfg` is made for, read from its configs (no weights loaded)."""
    if not cfg.path:
        return cfg.tiny.image_size
    root = Path(cfg.path)
    vae = json.loads((root / "vae" / "config.json").read_text())
    transformer = json.loads((root / "transformer" / "config.json").read_text())
    return int(transformer["sample_size"]) * 2 ** (len(vae["block_out_channels"]) - 1)


@families.register("sd3")
class SD3(FlowFamily):
    name = "sd3"
    config = SD3ModelConfig
    produces = ("image",)
    pipelines = ("StableDiffusion3Pipeline",)
    lora_targets = SD3_LORA_TARGETS
    modules = ("diffusers.models.transformers.transformer_sd3", "diffusers.models.autoencoders.autoencoder_kl",
               "transformers.models.clip.modeling_clip", "transformers.models.t5.modeling_t5", "peft")

    @classmethod
    def check(cls, recipe: Any) -> None:
        size = recipe.rollout.sampler.image_size
        if size is not None and not recipe.model.path:
            tiny = recipe.model.tiny
            check_image_side("rollout.sampler.image_size", size, tiny.vae_factor, tiny.patch_size)
        super().check(recipe)

    @classmethod
    def native_media(cls, cfg: SD3ModelConfig) -> tuple[int, int | None]:
        return native_image_size(cfg), None

    @classmethod
    def materialize(cls, cfg: SD3ModelConfig, scratch: Path) -> Path:
        if cfg.path:
            d = Path(cfg.path)
            if not (d / "model_index.json").is_file():
                raise FileNotFoundError(f"model.path {d}: no model_index.json (expected a diffusers SD3 folder)")
            return super().materialize(cfg, scratch)
        from unirl.stages.models.sd3_tiny import build_tiny_sd3

        return build_tiny_sd3(scratch, **cfg.tiny.build_kwargs())

    @classmethod
    def load(cls, directory: Path, cfg: SD3ModelConfig, device: Any) -> SD3Bundle:
        return load_sd3(directory, dtype=getattr(torch, cfg.dtype), device=device)

    @classmethod
    def lora_what(cls, bundle: SD3Bundle) -> str:
        return f"the SD3 transformer in {bundle.directory}"

    # -- what the flow policy asks of a flow family (stages/models/flow_family.py) -------------
    @classmethod
    def geometry(cls, bundle: SD3Bundle) -> FlowGeometry:
        return geometry(bundle)

    @classmethod
    def codec(cls, bundle: SD3Bundle) -> ShiftScale:
        return ShiftScale()

    @classmethod
    def default_image_size(cls, bundle: SD3Bundle) -> int:
        return bundle.default_image_size

    @classmethod
    def encode_prompt(cls, bundle: SD3Bundle, text: str) -> tuple[torch.Tensor, ...]:
        """(embeds (L, D), pooled (P,)) of one prompt."""
        from unirl.stages.models.sd3_text import encode_prompts

        e = encode_prompts(bundle, [text])
        return e.embeds[0], e.pooled[0]

    @classmethod
    def forward(cls, bundle: SD3Bundle, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """SD3's MMDiT on (B, C, h, w) latents, timestep = sigma * 1000."""
        embeds, pooled = cond
        dtype = module.dtype
        return module(hidden_states=x.to(dtype), timestep=sigma * TIMESTEP_SCALE, encoder_hidden_states=embeds.to(dtype),
                      pooled_projections=pooled.to(dtype), return_dict=False)[0].float()

"""The `sd3` family: Stable Diffusion 3 (diffusers SD3Transformer2DModel, an MMDiT; AutoencoderKL; two
CLIP text encoders and a T5), from a local diffusers folder (stable-diffusion-3-medium-diffusers,
StableDiffusion3Pipeline) or a tiny seeded one built in code.

Latents (C, H/f, W/f): the VAE's, normalized x = (z - shift_factor) * scaling_factor (flow_vae.py
`ShiftScale`); the transformer patchifies them itself (patch p, at most `pos_embed_max_size` patches
a side) and takes timestep = sigma * 1000 (the scheduler's num_train_timesteps), not an integer index.
Text, per prompt:
  embeds (L_clip + L_t5, D_joint) = cat_seq(pad_to_D_joint(cat_feat(clip_l[-2], clip_g[-2])), t5)
  pooled (P,) = cat_feat(clip_l.text_embeds, clip_g.text_embeds)
where clip[-2] is the penultimate hidden state, D_joint the transformer's joint_attention_dim, both
CLIPs read the first tokenizer's length and T5 min(256, its tokenizer's) tokens; a folder without T5
gets 256 zero rows in its place, as diffusers' pipeline does.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from unirl.stages.kernels import no_grad
from unirl.stages.models import flow_text as T
from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase, MemoryProbe, lora_parameters
from unirl.stages.models.flow_folder import config_of, listed, read_index, write_index
from unirl.stages.models.flow_geometry import FlowGeometry, check_image_side
from unirl.stages.models.flow_vae import ShiftScale
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import families

if TYPE_CHECKING:
    import torch

# The attention projections of every MMDiT block (image and text streams), as Flow-GRPO targets.
SD3_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
# SD3's pipeline default for the T5 sequence (and the zero rows that replace a missing T5).
T5_LENGTH = 256
# The tiny model's text side: CLIP width (T5 and the joint attention are twice it) and tokens per prompt.
TINY_CLIP_HIDDEN = 32
TINY_TEXT_LENGTH = 16


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


class SD3ModelConfig(FlowModelBase):
    """Stable Diffusion 3 architecture (diffusers SD3Transformer2DModel + AutoencoderKL + text encoders)."""

    kind: Literal["sd3"] = "sd3"
    tiny: TinySD3 = Field(default_factory=TinySD3, description="Tiny architecture, used only without `path`.")


# ---------------------------------------------------------------------------- configs and sizes


def tiny_vae_config(tiny: TinySD3) -> dict[str, Any]:
    """AutoencoderKL kwargs of the tiny model, with SD3's own VAE normalization so its path is the real one."""
    blocks = len(tiny.vae_channels)
    return {"in_channels": 3, "out_channels": 3, "latent_channels": tiny.latent_channels,
            "down_block_types": ["DownEncoderBlock2D"] * blocks, "up_block_types": ["UpDecoderBlock2D"] * blocks,
            "block_out_channels": list(tiny.vae_channels), "layers_per_block": 1, "norm_num_groups": 8,
            "sample_size": tiny.image_size, "use_quant_conv": False, "use_post_quant_conv": False,
            "mid_block_add_attention": tiny.vae_mid_attention, "scaling_factor": 1.5305, "shift_factor": 0.0609}


def tiny_transformer_config(tiny: TinySD3) -> dict[str, Any]:
    """SD3Transformer2DModel kwargs of the tiny model; its position table covers twice `image_size`."""
    latent = tiny.image_size // tiny.vae_factor
    return {"sample_size": latent, "patch_size": tiny.patch_size, "in_channels": tiny.latent_channels,
            "out_channels": tiny.latent_channels, "num_layers": tiny.num_layers, "attention_head_dim": tiny.head_dim,
            "num_attention_heads": tiny.num_heads, "joint_attention_dim": 2 * TINY_CLIP_HIDDEN,
            "caption_projection_dim": tiny.num_heads * tiny.head_dim, "pooled_projection_dim": 2 * TINY_CLIP_HIDDEN,
            "pos_embed_max_size": 2 * latent // tiny.patch_size}


def geometry_of(vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    """Pixels -> latents (the VAE's factor) -> tokens (the patch, up to the position table's side)."""
    return FlowGeometry(channels=int(transformer.get("in_channels", 16)), spatial=vae_factor(vae),
                        patch=int(transformer.get("patch_size", 2)), max_patches=transformer.get("pos_embed_max_size", 96),
                        what=f"the SD3 model in {where}")


def vae_factor(vae: dict[str, Any]) -> int:
    return 2 ** (len(vae.get("block_out_channels", (128, 256, 512, 512))) - 1)


def image_side(vae: dict[str, Any], transformer: dict[str, Any]) -> int:
    """The image side a folder is made for: the transformer's sample_size latent pixels times the
    VAE's factor (the pipeline's default height)."""
    return int(transformer.get("sample_size", 128)) * vae_factor(vae)


# ---------------------------------------------------------------------------- the family


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
    def recipe_geometry(cls, cfg: SD3ModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            return geometry_of(config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer"), cfg.path)
        return geometry_of(tiny_vae_config(cfg.tiny), tiny_transformer_config(cfg.tiny), "model.tiny")

    @classmethod
    def native_media(cls, cfg: SD3ModelConfig) -> tuple[int, int | None]:
        # An SD3 folder's configs say its image side (image_side), so SD3 needs no defaults file:
        # its tiny folders write none, as a checkpoint has none, and the base would answer 1024.

        if not cfg.path:
            return super().native_media(cfg)
        return image_side(config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer")), None

    @classmethod
    def memory_probe(cls, cfg: SD3ModelConfig) -> MemoryProbe:
        """The folder's (or the tiny model's) parameters from its configs, its text tokens (both
        CLIPs' length, then T5's or the zero rows' (module docstring)) and a transformer of its width."""
        with tempfile.TemporaryDirectory() as scratch:
            root = cls.materialize(cfg, Path(scratch))
            module, trained, buffers, frozen, block, outside = cls.probe_parts(root)

            def max_length(name: str, default: int) -> int:
                path = root / name / "tokenizer_config.json"
                return int(json.loads(path.read_text()).get("model_max_length", default)) if path.is_file() else default

            index = read_index(root)
            t5 = min(T5_LENGTH, max_length("tokenizer_3", T5_LENGTH)) if listed(index, "tokenizer_3") else T5_LENGTH
            text_tokens = max_length("tokenizer", 77) + t5
            config = config_of(root, "transformer")
        lora = lora_parameters(module, cfg.lora.rank, cfg.lora.target_modules or cls.lora_targets) if cfg.lora else 0

        def make(blocks: int, dtype: str) -> tuple[Any, Any]:
            import torch  # start-up time: loaded on first use
            from diffusers import SD3Transformer2DModel  # start-up time: loaded on first use

            default = torch.get_default_dtype()
            torch.set_default_dtype(getattr(torch, dtype))  # built in the recipe's dtype, as a checkpoint loads
            try:
                # its position table only as large as the probe's 8 x 8 patches need (no activations in it)
                table = {"pos_embed_max_size": min(16, config["pos_embed_max_size"]),
                         "sample_size": min(32, config.get("sample_size", 128))} if config.get("pos_embed_max_size") else {}
                module = SD3Transformer2DModel.from_config({**config, "num_layers": blocks, **table})
            finally:
                torch.set_default_dtype(default)

            def run(m: Any, x: torch.Tensor, sigma: torch.Tensor, text: int) -> torch.Tensor:
                cond = (torch.zeros(x.shape[0], text, config["joint_attention_dim"]),
                        torch.zeros(x.shape[0], config["pooled_projection_dim"]))
                return cls.forward(None, m, x, sigma, cond, None)

            return module, run

        return MemoryProbe(trained=trained, buffers=buffers, frozen=frozen, blocks=len(cls.fsdp_units(module)),
                           block_params=block, outside=outside, lora=lora, text_tokens=text_tokens, cfg_doubles=True,
                           make=make)

    # -- the folder -----------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinySD3) -> Path:
        """Every part seeded from `tiny.seed * 100 + k`, k over text_encoder, text_encoder_2,
        text_encoder_3, vae, transformer (k = 2 is skipped without T5); all three text encoders
        read one CLIP tokenizer, saved once per tokenizer folder."""
        # start-up time: diffusers loads on first use, not when a recipe is read
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        seed = tiny.seed * 100
        tok = T.build_tiny_clip_tokenizer(model_max_length=TINY_TEXT_LENGTH)
        encoders = {"text_encoder": T.tiny_clip(tok, hidden=TINY_CLIP_HIDDEN, seed=seed),
                    "text_encoder_2": T.tiny_clip(tok, hidden=TINY_CLIP_HIDDEN, seed=seed + 1)}
        if tiny.with_t5:
            encoders["text_encoder_3"] = T.tiny_t5(tok, hidden=2 * TINY_CLIP_HIDDEN, seed=seed + 2)
        for name, encoder in encoders.items():
            encoder.save_pretrained(root / name)
            tok.save_pretrained(root / name.replace("text_encoder", "tokenizer"))
        T.seeded(seed + 3, lambda: AutoencoderKL(**tiny_vae_config(tiny))).save_pretrained(root / "vae")
        T.seeded(seed + 4, lambda: SD3Transformer2DModel(**tiny_transformer_config(tiny))).save_pretrained(root / "transformer")
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).save_pretrained(root / "scheduler")
        clip, t5 = ("transformers", "CLIPTextModelWithProjection"), ("transformers", "T5EncoderModel")
        tokenizer = ("transformers", "CLIPTokenizer")
        write_index(root, "StableDiffusion3Pipeline", {
            "transformer": ("diffusers", "SD3Transformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"), "image_encoder": None, "feature_extractor": None,
            "text_encoder": clip, "tokenizer": tokenizer, "text_encoder_2": clip, "tokenizer_2": tokenizer,
            "text_encoder_3": t5 if tiny.with_t5 else None, "tokenizer_3": tokenizer if tiny.with_t5 else None,
        })
        return root

    @classmethod
    def load(cls, directory: Path, cfg: SD3ModelConfig, device: Any) -> FlowBundle:
        """Both CLIPs always, T5 where the index lists it; settings: `image_size` (image_side) and
        `text_length`, T5's tokens per prompt or the zero rows standing in for it."""
        index = read_index(Path(directory))
        t5 = listed(index, "text_encoder_3") or listed(index, "tokenizer_3")
        text = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", *(("text_encoder_3", "tokenizer_3") if t5 else ()))
        parts = cls.load_parts(directory, cfg, device, text=text)
        (transformer,) = parts.transformers
        vae, config = dict(parts.vae.config), dict(transformer.config)
        t5_tokenizer = parts.text.get("tokenizer_3")
        settings = {"image_size": image_side(vae, config),
                    "text_length": T5_LENGTH if t5_tokenizer is None else min(T5_LENGTH, t5_tokenizer.model_max_length)}
        return FlowBundle(transformer, parts.vae, parts.text, parts.root, parts.index, geometry_of(vae, config, str(parts.root)),
                          settings)

    # -- what the flow policy asks --------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: FlowBundle) -> ShiftScale:
        return ShiftScale()

    @classmethod
    @no_grad
    def encode_prompt(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, ...]:
        """(embeds (L_clip + L_t5, D_joint), pooled (P,)) of one prompt (module docstring)."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        import torch.nn.functional as F  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models.flow_text import ids_and_mask

        device, joint = bundle.device, bundle.transformer.config.joint_attention_dim
        clip_length = bundle.text["tokenizer"].model_max_length  # both CLIPs use the first one's, as in SD3
        hidden, pooled = [], []
        for suffix in ("", "_2"):
            ids, _ = ids_and_mask(bundle.text["tokenizer" + suffix], text, clip_length)
            out = bundle.text["text_encoder" + suffix](ids.to(device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2][0])
            pooled.append(out.text_embeds[0])
        clip = torch.cat(hidden, dim=-1)
        if clip.shape[-1] > joint:
            raise ValueError(f"the CLIP encoders in {bundle.directory} give {clip.shape[-1]} features, more than the "
                             f"transformer's joint_attention_dim {joint}")
        clip = F.pad(clip, (0, joint - clip.shape[-1]))
        length = bundle.settings["text_length"]
        if "text_encoder_3" in bundle.text:
            ids, _ = ids_and_mask(bundle.text["tokenizer_3"], text, length)
            t5 = bundle.text["text_encoder_3"](ids.to(device))[0][0].to(clip.dtype)
        else:
            t5 = clip.new_zeros(length, joint)
        return torch.cat([clip, t5]).to(bundle.dtype), torch.cat(pooled).to(bundle.dtype)

    @classmethod
    def forward(cls, bundle: FlowBundle | None, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """SD3's MMDiT on (B, C, h, w) latents, timestep = sigma * 1000 (nothing of the bundle is
        needed: the memory probe calls it with none)."""
        embeds, pooled = cond
        dtype = module.dtype
        return module(hidden_states=x.to(dtype), timestep=sigma * cls.timestep_scale, encoder_hidden_states=embeds.to(dtype),
                      pooled_projections=pooled.to(dtype), return_dict=False)[0].float()

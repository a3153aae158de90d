"""The `flux2_klein` family: FLUX.2 [klein] (diffusers Flux2Transformer2DModel + AutoencoderKLFlux2 +
a Qwen3 text encoder), from a local diffusers folder (FLUX.2-klein-4B / -base-4B, Flux2KleinPipeline)
or a tiny seeded one built in code.

Latents: the VAE's (C, H/8, W/8) patchified 2x2 to (4C, H/16, W/16) and normalized by the VAE's
BatchNorm statistics (stages/models/flow_vae.py `PatchBatchNorm`), as the pipeline samples them; the
transformer (patch 1) takes them as H/16 * W/16 tokens with 4-D position ids (t, h, w, l) = (0, i, j,
0), the text as tokens (0, 0, 0, l). It multiplies its timestep input by 1000 itself, so it is
given sigma. Text: the chat-templated prompt through Qwen3, the hidden states of three layers at a
quarter, half and three quarters of its depth (9, 18, 27 of Qwen3-4B's 36) stacked per token.

Guidance: a guidance-distilled transformer (`guidance_embeds`) takes the sampler's guidance_scale
as its guidance input (times 1000 inside) and no CFG; Klein's own transformers have no guidance
embedding and use CFG with a negative prompt (the base models) or guidance 1 (the distilled ones).
The schedule's resolution-dependent shift is FLUX.2's empirical mu (`dynamic_mu`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from unirl.stages.kernels import no_grad
from unirl.stages.models import flow_text as T
from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase, TinyFlow
from unirl.stages.models.flow_folder import config_of, folder_defaults, write_defaults, write_index
from unirl.stages.models.flow_geometry import FlowGeometry
from unirl.stages.models.flow_vae import PatchBatchNorm
from unirl.stages.runtime.registry import families

if TYPE_CHECKING:
    import torch

FLUX2_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj")


class TinyFlux2(TinyFlow):
    """Architecture of the seeded random FLUX.2 [klein] used when `model.path` is empty."""

    num_single_layers: int = Field(1, ge=0, description="Single-stream blocks after the `num_layers` double-stream ones.")
    guidance_embeds: bool = Field(True, description="Guidance-distilled: the guidance scale is an input, not CFG.")
    text_layers: int = Field(4, ge=4, description="Layers of the tiny Qwen3 (three of them, at 1/4, 1/2, 3/4, are read).")
    patch_size: int = Field(1, ge=1, le=1, description="FLUX.2's transformer patch is 1 (the VAE latents are patchified 2x2).")


class Flux2KleinModelConfig(FlowModelBase):
    """FLUX.2 [klein] (diffusers Flux2Transformer2DModel + AutoencoderKLFlux2 + Qwen3)."""

    kind: Literal["flux2_klein"] = "flux2_klein"
    tiny: TinyFlux2 = Field(default_factory=TinyFlux2, description="Tiny architecture, used only without `path`.")


def text_layers(depth: int) -> tuple[int, ...]:
    """Hidden states read of a `depth`-layer encoder: at 1/4, 1/2 and 3/4 of it ((9, 18, 27) for 36)."""
    return depth // 4, depth // 2, 3 * depth // 4


def geometry_of(vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    factor = 2 ** (len(vae.get("block_out_channels", (128, 256, 512, 512))) - 1)
    return FlowGeometry(channels=int(transformer.get("in_channels", 128)), spatial=2 * factor,
                        patch=int(transformer.get("patch_size", 1)), what=f"the FLUX.2 model in {where}")


def empirical_mu(tokens: int, num_steps: int) -> float:
    """FLUX.2's shift mu for `tokens` image tokens and `num_steps` steps: linear in the tokens, fitted
    at 10 and 200 steps and interpolated linearly in the steps between them (above 4300 tokens,
    the 200-step line alone)."""
    at_200 = 0.00016927 * tokens + 0.45666666
    if tokens > 4300:
        return float(at_200)
    at_10 = 8.73809524e-05 * tokens + 1.89833333
    slope = (at_200 - at_10) / 190.0
    return float(at_200 + slope * (num_steps - 200.0))


@families.register("flux2_klein")
class Flux2Klein(FlowFamily):
    name = "flux2_klein"
    config = Flux2KleinModelConfig
    produces = ("image",)
    pipelines = ("Flux2KleinPipeline",)
    lora_targets = FLUX2_LORA_TARGETS
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    timestep_scale = 1.0
    pipeline_defaults = {"image_size": 1024, "num_frames": None, "text_length": 512}
    modules = ("diffusers.models.transformers.transformer_flux2", "diffusers.models.autoencoders.autoencoder_kl_flux2",
               "transformers.models.qwen3.modeling_qwen3", "peft")

    @classmethod
    def recipe_geometry(cls, cfg: Flux2KleinModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            return geometry_of(config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer"), cfg.path)
        t = cfg.tiny
        return geometry_of({"block_out_channels": t.vae_channels}, {"in_channels": 4 * t.latent_channels, "patch_size": t.patch_size},
                           "model.tiny")

    # -- the folder -----------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinyFlux2) -> Path:
        # start-up time: diffusers loads on first use, not when a recipe is read
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        tok = T.build_tiny_tokenizer(model_max_length=tiny.text_length)
        tok.save_pretrained(root / "tokenizer")
        T.tiny_qwen3(tok, hidden=tiny.text_hidden, layers=tiny.text_layers, seed=tiny.seed * 100).save_pretrained(root / "text_encoder")
        blocks = len(tiny.vae_channels)
        vae = {"block_out_channels": tuple(tiny.vae_channels), "down_block_types": ("DownEncoderBlock2D",) * blocks,
               "up_block_types": ("UpDecoderBlock2D",) * blocks, "layers_per_block": 1, "latent_channels": tiny.latent_channels,
               "norm_num_groups": 4, "mid_block_add_attention": False, "use_quant_conv": False, "use_post_quant_conv": False,
               "sample_size": tiny.image_size}
        T.seeded(tiny.seed * 100 + 1, lambda: AutoencoderKLFlux2(**vae)).save_pretrained(root / "vae")
        axes = tiny.head_dim // 4
        spec = {"patch_size": tiny.patch_size, "in_channels": 4 * tiny.latent_channels, "num_layers": tiny.num_layers,
                "num_single_layers": tiny.num_single_layers, "attention_head_dim": tiny.head_dim,
                "num_attention_heads": tiny.num_heads, "joint_attention_dim": 3 * tiny.text_hidden,
                "timestep_guidance_channels": 32, "axes_dims_rope": (axes,) * 4, "guidance_embeds": tiny.guidance_embeds}
        T.seeded(tiny.seed * 100 + 2, lambda: Flux2Transformer2DModel(**spec)).save_pretrained(root / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True).save_pretrained(root / "scheduler")
        write_index(root, "Flux2KleinPipeline", {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"), "vae": ("diffusers", "AutoencoderKLFlux2"),
            "text_encoder": ("transformers", "Qwen3ForCausalLM"), "tokenizer": ("transformers", "PreTrainedTokenizerFast"),
            "transformer": ("diffusers", "Flux2Transformer2DModel"),
        }, is_distilled=False)
        write_defaults(root, **cls.tiny_defaults(tiny))
        return root

    @classmethod
    def load(cls, directory: Path, cfg: Flux2KleinModelConfig, device: Any) -> FlowBundle:
        parts = cls.load_parts(directory, cfg, device)
        (transformer,) = parts.transformers
        geo = geometry_of(dict(parts.vae.config), dict(transformer.config), str(parts.root))
        settings = {**folder_defaults(parts.root, cls.pipeline_defaults),
                    "layers": text_layers(parts.text["text_encoder"].config.num_hidden_layers)}
        return FlowBundle(transformer, parts.vae, parts.text, parts.root, parts.index, geo, settings)

    # -- what the flow policy asks --------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: FlowBundle) -> PatchBatchNorm:
        return PatchBatchNorm()

    @classmethod
    def uses_cfg(cls, bundle: FlowBundle) -> bool:
        return not bool(bundle.transformer.config.guidance_embeds)

    @classmethod
    def dynamic_mu(cls, bundle: FlowBundle, tokens: int, num_steps: int) -> float:
        return empirical_mu(tokens, num_steps)

    @classmethod
    @no_grad
    def encode_prompt(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, ...]:
        """(embeds (L, 3 * D),): the templated prompt's hidden states at the three layers, per token."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models.flow_text import ids_and_mask

        tok = bundle.text["tokenizer"]
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        ids, mask = ids_and_mask(tok, chat, bundle.settings["text_length"])
        out = bundle.text["text_encoder"](input_ids=ids.to(bundle.device), attention_mask=mask.to(bundle.device),
                                          output_hidden_states=True, use_cache=False)
        layers = torch.stack([out.hidden_states[k][0] for k in bundle.settings["layers"]], dim=1)  # (L, 3, D)
        return (layers.reshape(layers.shape[0], -1).to(bundle.dtype),)

    @classmethod
    def forward(cls, bundle: FlowBundle, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """Flux2Transformer2DModel on (B, 4C, h, w) latents as h * w tokens, timestep sigma."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        (embeds,) = cond
        b, c, h, w = x.shape
        dtype = module.dtype
        tokens = x.reshape(b, c, h * w).permute(0, 2, 1)
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(x.device)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                       torch.arange(embeds.shape[1])).to(x.device)
        g = None if guidance is None else torch.full((b,), float(guidance), device=x.device)
        out = module(hidden_states=tokens.to(dtype), encoder_hidden_states=embeds.to(dtype), timestep=sigma * cls.timestep_scale,
                     img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False)[0]
        return out.permute(0, 2, 1).reshape(b, c, h, w).float()

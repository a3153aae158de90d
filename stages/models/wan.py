"""The `wan` family: Wan 2.1 and 2.2 text-to-video (diffusers WanTransformer3DModel + AutoencoderKLWan
+ a UMT5 text encoder), from a local diffusers folder (Wan2.1-T2V-*-Diffusers, Wan2.2-T2V-A14B-Diffusers)
or a tiny seeded one built in code.

Wan 2.2's A14B has two experts: `transformer` denoises high noise, `transformer_2` low noise, split
at boundary timestep = boundary_ratio * 1000 (model_index.json's `boundary_ratio`, 0.875). Both are
the trainable module (`WanExperts`, stages/models/modules/wan_experts.py): the velocity at sigma
comes from the expert whose range holds sigma * 1000, so sampling, the losses and the trainer's replay all switch where the pipeline does.

Latents (C, F', h, w), F' = 1 + (F - 1) / 4 for the real VAE (F = 1 + 4k frames), h = H / 8; the
transformer patches them (1, 2, 2) itself, and takes timestep = sigma * 1000 (per token for
2.2's `expand_timesteps`). Text: the UMT5 encoder's last hidden state of the first L tokens, zero
rows after the prompt's own (the pipeline's 512 for a checkpoint). CFG with a negative prompt.
Default shift: 3.0 at 480p, 5.0 at 720p (the recipes set it).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from unirl.stages.kernels import no_grad
from unirl.stages.models import flow_text as T
from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase, TinyVideo
from unirl.stages.models.flow_folder import config_of, folder_defaults, write_defaults, write_index
from unirl.stages.models.flow_geometry import FlowGeometry
from unirl.stages.models.flow_vae import ChannelStats
from unirl.stages.runtime.registry import families

if TYPE_CHECKING:
    import torch

WAN_LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


class TinyWan(TinyVideo):
    """Architecture of the seeded random Wan used when `model.path` is empty."""

    experts: Literal[1, 2] = Field(1, description="1: Wan 2.1 (one transformer); 2: Wan 2.2's high- and low-noise experts.")
    boundary_ratio: float = Field(0.875, gt=0, lt=1, description="Wan 2.2: the experts' boundary, as a fraction of 1000 timesteps.")
    vae_temporal: bool = Field(False, description="The VAE halves time twice (frames 1 + 4k -> 1 + k), as the real one does.")


class WanModelConfig(FlowModelBase):
    """Wan 2.1 / 2.2 text-to-video (diffusers WanTransformer3DModel + AutoencoderKLWan + UMT5)."""

    kind: Literal["wan"] = "wan"
    tiny: TinyWan = Field(default_factory=TinyWan, description="Tiny architecture, used only without `path`.")


def geometry_of(vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    downs = vae.get("temperal_downsample", [False, True, True])
    spatial = vae.get("scale_factor_spatial") or 2 ** len(downs)
    temporal = vae.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in downs)
    pt, ph, _ = transformer.get("patch_size", (1, 2, 2))
    return FlowGeometry(channels=int(transformer.get("in_channels", 16)), spatial=int(spatial), patch=int(ph),
                        temporal=int(temporal), frame_step=4, patch_t=int(pt), what=f"the Wan model in {where}")


@families.register("wan")
class Wan(FlowFamily):
    name = "wan"
    config = WanModelConfig
    produces = ("video",)
    pipelines = ("WanPipeline",)
    lora_targets = WAN_LORA_TARGETS
    block_lists = ("blocks",)
    pipeline_defaults = {"image_size": 480, "num_frames": 81, "text_length": 512}
    modules = ("diffusers.models.transformers.transformer_wan", "diffusers.models.autoencoders.autoencoder_kl_wan",
               "transformers.models.umt5.modeling_umt5", "peft")

    @classmethod
    def recipe_geometry(cls, cfg: WanModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            transformer = config_of(Path(cfg.path), "transformer" if (Path(cfg.path) / "transformer").is_dir() else "transformer_2")
            return geometry_of(config_of(Path(cfg.path), "vae"), transformer, cfg.path)
        t = cfg.tiny
        vae = tiny_vae_config(t)
        return geometry_of(vae, {"patch_size": (1, t.patch_size, t.patch_size), "in_channels": t.latent_channels}, "model.tiny")

    # -- the folder -----------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinyWan) -> Path:
        # start-up time: diffusers loads on first use, not when a recipe is read
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        tok = T.build_tiny_tokenizer(model_max_length=tiny.text_length)
        tok.save_pretrained(root / "tokenizer")
        T.tiny_umt5(tok, hidden=tiny.text_hidden, layers=tiny.text_layers, seed=tiny.seed * 100).save_pretrained(root / "text_encoder")
        T.seeded(tiny.seed * 100 + 1, lambda: AutoencoderKLWan(**tiny_vae_config(tiny))).save_pretrained(root / "vae")
        inner = tiny.num_heads * tiny.head_dim
        spec = {"patch_size": (1, tiny.patch_size, tiny.patch_size), "num_attention_heads": tiny.num_heads,
                "attention_head_dim": tiny.head_dim, "in_channels": tiny.latent_channels, "out_channels": tiny.latent_channels,
                "text_dim": tiny.text_hidden, "freq_dim": 32, "ffn_dim": 2 * inner, "num_layers": tiny.num_layers,
                "rope_max_seq_len": 64}
        names = ["transformer", "transformer_2"][:tiny.experts]
        for k, name in enumerate(names):
            T.seeded(tiny.seed * 100 + 2 + k, lambda: WanTransformer3DModel(**spec)).save_pretrained(root / name)
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(root / "scheduler")
        two = tiny.experts == 2
        write_index(root, "WanPipeline", {
            "tokenizer": ("transformers", "PreTrainedTokenizerFast"), "text_encoder": ("transformers", "UMT5EncoderModel"),
            "vae": ("diffusers", "AutoencoderKLWan"), "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "transformer": ("diffusers", "WanTransformer3DModel"),
            "transformer_2": ("diffusers", "WanTransformer3DModel") if two else None,
        }, boundary_ratio=tiny.boundary_ratio if two else None, expand_timesteps=False)
        write_defaults(root, **cls.tiny_defaults(tiny))
        return root

    @classmethod
    def load(cls, directory: Path, cfg: WanModelConfig, device: Any) -> FlowBundle:
        parts = cls.load_parts(directory, cfg, device, experts=("transformer", "transformer_2"))
        experts, index = parts.transformers, parts.index
        if len(experts) == 2:
            from unirl.stages.models.modules.wan_experts import WanExperts  # start-up time: a torch module, built on load

            module: Any = WanExperts(experts[0], experts[1], boundary=float(index["boundary_ratio"]) * 1000).eval()
        else:
            module = experts[0]
        geo = geometry_of(dict(parts.vae.config), dict(experts[0].config), str(parts.root))
        settings = {**folder_defaults(parts.root, cls.pipeline_defaults),
                    "expand_timesteps": bool(index.get("expand_timesteps") or False)}
        return FlowBundle(module, parts.vae, parts.text, parts.root, index, geo, settings)

    @classmethod
    def transformers(cls, module: Any) -> list[Any]:
        from unirl.stages.models.modules.wan_experts import WanExperts  # start-up time: a torch module

        return [module.transformer, module.transformer_2] if isinstance(module, WanExperts) else [module]

    @classmethod
    def split_state(cls, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        if not any(k.startswith("transformer_2.") for k in state):
            return {"transformer": state}
        return {name: {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
                for name in ("transformer", "transformer_2")}

    # -- what the flow policy asks --------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: FlowBundle) -> ChannelStats:
        return ChannelStats()

    @classmethod
    @no_grad
    def encode_prompt(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, ...]:
        """(embeds (L, D),): the encoder's last hidden state over the prompt's tokens, zero rows after."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models.flow_text import ids_and_mask

        length = bundle.settings["text_length"]
        ids, mask = ids_and_mask(bundle.text["tokenizer"], text.strip(), length)
        encoder = bundle.text["text_encoder"]
        hidden = encoder(ids.to(bundle.device), mask.to(bundle.device)).last_hidden_state[0]
        valid = int(mask.sum())
        embeds = torch.cat([hidden[:valid], hidden.new_zeros(length - valid, hidden.shape[-1])])
        return (embeds.to(bundle.dtype),)

    @classmethod
    def forward(cls, bundle: FlowBundle, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """WanTransformer3DModel (or the experts) on (B, C, F', h, w), timestep = sigma * 1000."""
        (embeds,) = cond
        timestep = sigma * cls.timestep_scale
        if bundle.settings.get("expand_timesteps"):  # Wan 2.2 TI2V: one timestep per token, all equal in text-to-video
            geo = bundle.geometry
            timestep = timestep[:, None].expand(-1, geo.tokens(tuple(x.shape[1:])))
        dtype = module.dtype
        return module(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=embeds.to(dtype),
                      return_dict=False)[0].float()


def tiny_vae_config(tiny: TinyWan) -> dict[str, Any]:
    """AutoencoderKLWan kwargs of the tiny model: `vae_channels` blocks (downsampling space by
    2**(len-1)), time halved twice when `vae_temporal` (needs 3+ blocks), latents unnormalized
    until SFT fits them."""
    downs = len(tiny.vae_channels) - 1
    temporal = [tiny.vae_temporal and i >= downs - 2 for i in range(downs)]
    base = tiny.vae_channels[0]
    return {"base_dim": base, "z_dim": tiny.latent_channels, "dim_mult": [c // base for c in tiny.vae_channels],
            "num_res_blocks": 1, "temperal_downsample": temporal, "latents_mean": [0.0] * tiny.latent_channels,
            "latents_std": [1.0] * tiny.latent_channels, "scale_factor_spatial": 2 ** downs,
            "scale_factor_temporal": 2 ** sum(temporal)}

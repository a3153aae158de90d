"""The `qwen_image` family: Qwen-Image (diffusers QwenImageTransformer2DModel + AutoencoderKLQwenImage +
a Qwen2.5-VL text encoder), from a local diffusers folder (Qwen-Image, QwenImagePipeline) or a tiny
seeded one built in code.

Latents (C, H/8, W/8): the video VAE's one-frame latents, normalized per channel by its
latents_mean / latents_std; the transformer takes them packed 2x2 into (H/16 * W/16) tokens of 4C
channels, with `img_shapes` [(1, H/16, W/16)] for its RoPE, and its timestep as sigma (it scales by
1000 itself). Text: the prompt in Qwen-Image's description template through Qwen2.5-VL, the last
hidden state of the prompt's own tokens (the template's prefix dropped), padded to L with a mask.
CFG is Qwen-Image's "true CFG": the guided velocity rescaled per token to the conditional one's norm.
The resolution-dependent shift reads the scheduler's base/max shift (`dynamic_mu`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from unirl.stages.kernels import no_grad
from unirl.stages.models import flow_text as T
from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase, TinyFlow
from unirl.stages.models.flow_folder import config_of, folder_defaults, write_defaults, write_index
from unirl.stages.models.flow_geometry import FlowGeometry
from unirl.stages.models.flow_vae import ChannelStats
from unirl.stages.runtime.registry import families

if TYPE_CHECKING:
    import torch

QWEN_IMAGE_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                           "attn.add_v_proj", "attn.to_add_out")
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
            "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


class QwenImageModelConfig(FlowModelBase):
    """Qwen-Image (diffusers QwenImageTransformer2DModel + AutoencoderKLQwenImage + Qwen2.5-VL)."""

    kind: Literal["qwen_image"] = "qwen_image"
    tiny: TinyFlow = Field(default_factory=TinyFlow, description="Tiny architecture, used only without `path`.")


def geometry_of(vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
    return FlowGeometry(channels=int(vae.get("z_dim", 16)), spatial=factor, patch=int(transformer.get("patch_size", 2)),
                        what=f"the Qwen-Image model in {where}")


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch one token (channels, then the patch)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack`."""
    b = tokens.shape[0]
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


@families.register("qwen_image")
class QwenImage(FlowFamily):
    name = "qwen_image"
    config = QwenImageModelConfig
    produces = ("image",)
    pipelines = ("QwenImagePipeline",)
    lora_targets = QWEN_IMAGE_LORA_TARGETS
    timestep_scale = 1.0
    pipeline_defaults = {"image_size": 1328, "num_frames": None, "text_length": 512}
    modules = ("diffusers.models.transformers.transformer_qwenimage", "diffusers.models.autoencoders.autoencoder_kl_qwenimage",
               "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "peft")

    @classmethod
    def recipe_geometry(cls, cfg: QwenImageModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            return geometry_of(config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer"), cfg.path)
        t = cfg.tiny
        return geometry_of({"temperal_downsample": [False] * (len(t.vae_channels) - 1), "z_dim": t.latent_channels},
                           {"patch_size": t.patch_size}, "model.tiny")

    # -- the folder -----------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinyFlow) -> Path:
        # start-up time: diffusers loads on first use, not when a recipe is read
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

        if tiny.patch_size != 2:
            raise ValueError(f"model.tiny.patch_size: Qwen-Image packs latents 2x2, got {tiny.patch_size}")
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        tok = T.build_tiny_tokenizer(templates=(TEMPLATE,), model_max_length=256)
        tok.save_pretrained(root / "tokenizer")
        T.tiny_qwen25_vl(tok, hidden=tiny.text_hidden, layers=tiny.text_layers, seed=tiny.seed * 100).save_pretrained(root / "text_encoder")
        base = tiny.vae_channels[0]
        vae = {"base_dim": base, "z_dim": tiny.latent_channels, "dim_mult": [c // base for c in tiny.vae_channels],
               "num_res_blocks": 1, "temperal_downsample": [False] * (len(tiny.vae_channels) - 1),
               "latents_mean": [0.0] * tiny.latent_channels, "latents_std": [1.0] * tiny.latent_channels}
        T.seeded(tiny.seed * 100 + 1, lambda: AutoencoderKLQwenImage(**vae)).save_pretrained(root / "vae")
        frame_axis = tiny.head_dim // 4  # RoPE axes (frame, height, width), even, summing to the head width
        height_axis = (tiny.head_dim - frame_axis) // 4 * 2
        spec = {"patch_size": 2, "in_channels": 4 * tiny.latent_channels, "out_channels": tiny.latent_channels,
                "num_layers": tiny.num_layers, "attention_head_dim": tiny.head_dim, "num_attention_heads": tiny.num_heads,
                "joint_attention_dim": tiny.text_hidden,
                "axes_dims_rope": (frame_axis, height_axis, tiny.head_dim - frame_axis - height_axis)}
        T.seeded(tiny.seed * 100 + 2, lambda: QwenImageTransformer2DModel(**spec)).save_pretrained(root / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                        base_image_seq_len=256, max_image_seq_len=8192).save_pretrained(root / "scheduler")
        write_index(root, "QwenImagePipeline", {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"), "vae": ("diffusers", "AutoencoderKLQwenImage"),
            "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
            "tokenizer": ("transformers", "PreTrainedTokenizerFast"), "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        })
        write_defaults(root, **cls.tiny_defaults(tiny))
        return root

    @classmethod
    def load(cls, directory: Path, cfg: QwenImageModelConfig, device: Any) -> FlowBundle:
        parts = cls.load_parts(directory, cfg, device)
        root, (transformer,) = parts.root, parts.transformers
        scheduler = json.loads((root / "scheduler" / "scheduler_config.json").read_text()) \
            if (root / "scheduler" / "scheduler_config.json").is_file() else {}
        prefix = len(parts.text["tokenizer"](TEMPLATE.split("{}")[0]).input_ids)
        settings = {**folder_defaults(root, cls.pipeline_defaults), "prefix": prefix, "scheduler": scheduler}
        geo = geometry_of(dict(parts.vae.config), dict(transformer.config), str(root))
        return FlowBundle(transformer, parts.vae, parts.text, root, parts.index, geo, settings)

    # -- what the flow policy asks --------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: FlowBundle) -> ChannelStats:
        return ChannelStats()

    @classmethod
    def uses_cfg(cls, bundle: FlowBundle) -> bool:
        return not bool(bundle.transformer.config.guidance_embeds)

    @classmethod
    def dynamic_mu(cls, bundle: FlowBundle, tokens: int, num_steps: int) -> float:
        from unirl.stages.kernels.schedules import dynamic_shift  # start-up time: it loads torch

        s = bundle.settings["scheduler"]
        return dynamic_shift(tokens, base_seq_len=s.get("base_image_seq_len", 256), max_seq_len=s.get("max_image_seq_len", 4096),
                             base_shift=s.get("base_shift", 0.5), max_shift=s.get("max_shift", 1.15))

    @classmethod
    def combine_cfg(cls, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """True CFG, then each token's (2x2 patch's) guided velocity rescaled to the conditional one's norm."""
        guided = uncond + scale * (cond - uncond)
        b, c, h, w = cond.shape
        norm = lambda v: pack(v).norm(dim=-1, keepdim=True)  # noqa: E731 - per token, over its 4C channels
        return unpack(pack(guided) * (norm(cond) / norm(guided)), c, h, w)

    @classmethod
    @no_grad
    def encode_prompt(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, ...]:
        """(embeds (L, D), mask (L,)): the last hidden state of the prompt's tokens in the template."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models.flow_text import ids_and_mask, pad_rows

        length, prefix = bundle.settings["text_length"], bundle.settings["prefix"]
        tok = bundle.text["tokenizer"]
        ids, mask = ids_and_mask(tok, TEMPLATE.format(text), length + prefix)
        valid = int(mask.sum())
        ids, mask = ids[:, :valid], mask[:, :valid]
        out = bundle.text["text_encoder"](input_ids=ids.to(bundle.device), attention_mask=mask.to(bundle.device),
                                          output_hidden_states=True)
        hidden = out.hidden_states[-1][0, prefix:]
        embeds, keep = pad_rows(hidden, torch.ones(hidden.shape[0], dtype=torch.long, device=hidden.device), length)
        return embeds.to(bundle.dtype), keep

    @classmethod
    def forward(cls, bundle: FlowBundle, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """QwenImageTransformer2DModel on (B, C, h, w) latents packed 2x2, timestep sigma."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        embeds, mask = cond
        b, c, h, w = x.shape
        dtype = module.dtype
        g = None if guidance is None else torch.full((b,), float(guidance), device=x.device)
        out = module(hidden_states=pack(x).to(dtype), encoder_hidden_states=embeds.to(dtype), encoder_hidden_states_mask=mask,
                     timestep=sigma * cls.timestep_scale, img_shapes=[[(1, h // 2, w // 2)]] * b, guidance=g,
                     return_dict=False)[0]
        return unpack(out.float(), c, h, w)

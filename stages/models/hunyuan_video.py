"""The `hunyuan_video` family: HunyuanVideo 1.0 (diffusers HunyuanVideoTransformer3DModel +
AutoencoderKLHunyuanVideo + a Llama text encoder and a CLIP pooled one) and HunyuanVideo 1.5
(HunyuanVideo15Transformer3DModel + AutoencoderKLHunyuanVideo15 + a Qwen2.5-VL text encoder and a
ByT5 glyph encoder), text-to-video, from a local diffusers folder (HunyuanVideoPipeline /
HunyuanVideo15Pipeline: the folder says which) or a tiny seeded one built in code
(`model.tiny.version`).

Both take latents (C, F', h, w) (F' = 1 + (F - 1) / 4 at the real VAEs' temporal compression 4) and
a float timestep sigma * 1000. 1.0 is guidance-distilled: the sampler's guidance_scale is its
guidance input (times 1000, as the pipeline passes it; the pipeline's default is 6), no CFG, with
the Llama's third-to-last hidden state of the prompt in its video template (the template's prefix
cropped) and CLIP's pooled output. 1.5 uses CFG and takes its text-to-video inputs as the pipeline
builds them: the latents concatenated with zero image-condition latents and a zero mask (2C + 1
channels), a zero image embedding (one token: it is zeroed and masked out, whatever its length),
the Qwen2.5-VL's third-to-last hidden state of the chat-templated prompt, and the ByT5 embedding of
the prompt's quoted text (zero, masked, when it quotes none). Default shift: 7.0 (1.0), 5.0 (1.5).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from unirl.stages.kernels import no_grad
from unirl.stages.models import flow_text as T
from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase, TinyVideo
from unirl.stages.models.flow_folder import config_of, folder_defaults, read_index, write_defaults, write_index
from unirl.stages.models.flow_geometry import FlowGeometry
from unirl.stages.models.flow_text import ids_and_mask
from unirl.stages.models.flow_vae import Scale
from unirl.stages.runtime.registry import families

if TYPE_CHECKING:
    import torch

HUNYUAN_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                        "attn.add_v_proj", "attn.to_add_out")
PIPELINES = {"1.0": "HunyuanVideoPipeline", "1.5": "HunyuanVideo15Pipeline"}
LLAMA_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
SYSTEM_15 = ("You are a helpful assistant. Describe the video by detailing the following aspects: 1. The main content "
             "and theme of the video. 2. The color, shape, size, texture, quantity, text, and spatial relationships of the "
             "objects. 3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. "
             "4. background environment, light, style and atmosphere. 5. camera angles, movements, and transitions used "
             "in the video.")
QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")
SKIP_LAYERS = 2  # both versions read the hidden state 2 layers before the last


class TinyHunyuan(TinyVideo):
    """Architecture of the seeded random HunyuanVideo used when `model.path` is empty."""

    version: Literal["1.0", "1.5"] = Field("1.0", description="1.0 (guidance-distilled) or 1.5 (CFG, a glyph encoder).")
    num_single_layers: int = Field(1, ge=0, description="1.0: single-stream blocks after the double-stream ones.")
    vae_channels: list[int] = Field([8, 8, 8], min_length=2, description="VAE block widths.")
    vae_spatial: int = Field(2, ge=2, description="The VAE's spatial compression (a power of 2, fewer than the blocks).")
    vae_temporal: int = Field(4, ge=1, description="The VAE's temporal compression (1.0: 4 or 8; 1.5: at most vae_spatial).")
    text_layers: int = Field(2, ge=2, description="Layers of the tiny text encoder (its third-to-last hidden state is read).")


class HunyuanVideoModelConfig(FlowModelBase):
    """HunyuanVideo 1.0 / 1.5 text-to-video."""

    kind: Literal["hunyuan_video"] = "hunyuan_video"
    tiny: TinyHunyuan = Field(default_factory=TinyHunyuan, description="Tiny architecture, used only without `path`.")


def version_of(index: dict[str, Any]) -> str:
    return "1.5" if index.get("_class_name") == PIPELINES["1.5"] else "1.0"


def geometry_of(version: str, vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    channels = transformer.get("out_channels") if version == "1.5" else transformer.get("in_channels", 16)
    return FlowGeometry(channels=int(channels or 32), spatial=int(vae.get("spatial_compression_ratio", 8)),
                        patch=int(transformer.get("patch_size", 2)), temporal=int(vae.get("temporal_compression_ratio", 4)),
                        patch_t=int(transformer.get("patch_size_t", 1)), what=f"the HunyuanVideo {version} model in {where}")


def tiny_vae(tiny: TinyHunyuan) -> dict[str, Any]:
    if tiny.version == "1.5":
        return {"latent_channels": tiny.latent_channels, "block_out_channels": tuple(tiny.vae_channels), "layers_per_block": 1,
                "spatial_compression_ratio": tiny.vae_spatial, "temporal_compression_ratio": tiny.vae_temporal}
    blocks = len(tiny.vae_channels)
    return {"latent_channels": tiny.latent_channels, "block_out_channels": tuple(tiny.vae_channels),
            "down_block_types": ("HunyuanVideoDownBlock3D",) * blocks, "up_block_types": ("HunyuanVideoUpBlock3D",) * blocks,
            "layers_per_block": 1, "norm_num_groups": 4, "spatial_compression_ratio": tiny.vae_spatial,
            "temporal_compression_ratio": tiny.vae_temporal, "mid_block_add_attention": False}


@families.register("hunyuan_video")
class HunyuanVideo(FlowFamily):
    name = "hunyuan_video"
    config = HunyuanVideoModelConfig
    produces = ("video",)
    pipelines = tuple(PIPELINES.values())
    lora_targets = HUNYUAN_LORA_TARGETS
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    version_defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "1.0": {"image_size": 720, "num_frames": 129, "text_length": 256},
        "1.5": {"image_size": 480, "num_frames": 121, "text_length": 1000, "glyph_length": 256},
    }
    modules = ("diffusers.models.transformers.transformer_hunyuan_video", "diffusers.models.transformers.transformer_hunyuan_video15",
               "diffusers.models.autoencoders.autoencoder_kl_hunyuan_video", "transformers.models.llama.modeling_llama", "peft")

    @classmethod
    def native_media(cls, cfg: HunyuanVideoModelConfig) -> tuple[int, int | None]:
        if cfg.path:
            found = folder_defaults(Path(cfg.path), cls.version_defaults[version_of(read_index(Path(cfg.path)))])
            return int(found["image_size"]), found["num_frames"]
        return cfg.tiny.image_size, cfg.tiny.num_frames

    @classmethod
    def recipe_geometry(cls, cfg: HunyuanVideoModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            version = version_of(read_index(Path(cfg.path)))
            return geometry_of(version, config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer"), cfg.path)
        t = cfg.tiny
        transformer = {"in_channels": t.latent_channels, "out_channels": t.latent_channels, "patch_size": t.patch_size}
        return geometry_of(t.version, tiny_vae(t), transformer, "model.tiny")

    @classmethod
    def tiny_defaults(cls, tiny: TinyHunyuan) -> dict[str, Any]:
        return {**super().tiny_defaults(tiny), "glyph_length": 8} if tiny.version == "1.5" else super().tiny_defaults(tiny)

    # -- the folder -----------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinyHunyuan) -> Path:
        # start-up time: diffusers loads on first use, not when a recipe is read
        from diffusers import (
            AutoencoderKLHunyuanVideo,
            AutoencoderKLHunyuanVideo15,
            FlowMatchEulerDiscreteScheduler,
            HunyuanVideo15Transformer3DModel,
            HunyuanVideoTransformer3DModel,
        )

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        tok = T.build_tiny_tokenizer(templates=(LLAMA_TEMPLATE, SYSTEM_15), model_max_length=512)
        tok.save_pretrained(root / "tokenizer")
        frame_axis = tiny.head_dim // 4  # RoPE axes (frames, height, width), even, summing to the head width
        height_axis = (tiny.head_dim - frame_axis) // 4 * 2
        common = {"num_attention_heads": tiny.num_heads, "attention_head_dim": tiny.head_dim, "num_layers": tiny.num_layers,
                  "num_refiner_layers": 1, "patch_size": tiny.patch_size, "patch_size_t": 1, "text_embed_dim": tiny.text_hidden,
                  "rope_axes_dim": (frame_axis, height_axis, tiny.head_dim - frame_axis - height_axis)}
        seed = tiny.seed * 100
        if tiny.version == "1.5":
            T.tiny_qwen25_text(tok, hidden=tiny.text_hidden, layers=tiny.text_layers, seed=seed).save_pretrained(root / "text_encoder")
            glyph, glyph_tok = T.tiny_byt5(hidden=tiny.text_hidden, seed=seed + 3)
            vae = T.seeded(seed + 1, lambda: AutoencoderKLHunyuanVideo15(**tiny_vae(tiny)))
            transformer = T.seeded(seed + 2, lambda: HunyuanVideo15Transformer3DModel(
                in_channels=2 * tiny.latent_channels + 1, out_channels=tiny.latent_channels, text_embed_2_dim=tiny.text_hidden,
                image_embed_dim=tiny.text_hidden, target_size=tiny.image_size, task_type="t2v", **common))
            from diffusers import ClassifierFreeGuidance  # start-up time: diffusers loads on first use, not when a recipe is read

            guider = ClassifierFreeGuidance(guidance_scale=6.0)  # the pipeline's; unirl's CFG is the sampler's
            guider.save_pretrained(root / "guider")
            encoders = {"text_encoder": ("transformers", "Qwen2_5_VLTextModel"), "text_encoder_2": ("transformers", "T5EncoderModel"),
                        "tokenizer_2": ("transformers", "ByT5Tokenizer"), "guider": ("diffusers", "ClassifierFreeGuidance")}
            classes = ("AutoencoderKLHunyuanVideo15", "HunyuanVideo15Transformer3DModel")
        else:
            T.tiny_llama(tok, hidden=tiny.text_hidden, layers=tiny.text_layers, seed=seed).save_pretrained(root / "text_encoder")
            glyph, glyph_tok = T.tiny_clip_text(hidden=tiny.text_hidden, seed=seed + 3)
            vae = T.seeded(seed + 1, lambda: AutoencoderKLHunyuanVideo(**tiny_vae(tiny)))
            transformer = T.seeded(seed + 2, lambda: HunyuanVideoTransformer3DModel(
                in_channels=tiny.latent_channels, out_channels=tiny.latent_channels, num_single_layers=tiny.num_single_layers,
                guidance_embeds=True, pooled_projection_dim=tiny.text_hidden, **common))
            encoders = {"text_encoder": ("transformers", "LlamaModel"), "text_encoder_2": ("transformers", "CLIPTextModel"),
                        "tokenizer_2": ("transformers", "CLIPTokenizer")}
            classes = ("AutoencoderKLHunyuanVideo", "HunyuanVideoTransformer3DModel")
        glyph.save_pretrained(root / "text_encoder_2")
        glyph_tok.save_pretrained(root / "tokenizer_2")
        vae.save_pretrained(root / "vae")
        transformer.save_pretrained(root / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=7.0 if tiny.version == "1.0" else 5.0).save_pretrained(root / "scheduler")
        write_index(root, PIPELINES[tiny.version], {
            **encoders, "tokenizer": ("transformers", "PreTrainedTokenizerFast"), "vae": ("diffusers", classes[0]),
            "transformer": ("diffusers", classes[1]), "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        })
        write_defaults(root, **cls.tiny_defaults(tiny))
        return root

    @classmethod
    def load(cls, directory: Path, cfg: HunyuanVideoModelConfig, device: Any) -> FlowBundle:
        parts = cls.load_parts(directory, cfg, device, text=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        root, index, vae, text, (transformer,) = parts.root, parts.index, parts.vae, parts.text, parts.transformers
        version = version_of(index)
        if version == "1.5":
            vae.enable_slicing()  # diffusers 0.42's 1.5 VAE mid-block attention mask broadcasts wrongly past batch 1
        settings = {**folder_defaults(root, cls.version_defaults[version]), "version": version}
        if version == "1.5":
            chat = text["tokenizer"].apply_chat_template([{"role": "system", "content": SYSTEM_15}, {"role": "user", "content": "{}"}],
                                                         tokenize=False, add_generation_prompt=True)
            settings.update(template=chat, prefix=len(text["tokenizer"](chat.split("{}")[0], add_special_tokens=False).input_ids))
        else:
            settings.update(template=LLAMA_TEMPLATE, prefix=len(text["tokenizer"](LLAMA_TEMPLATE.split("{}")[0]).input_ids))
        geo = geometry_of(version, dict(vae.config), dict(transformer.config), str(root))
        return FlowBundle(transformer, vae, text, root, index, geo, settings)

    # -- what the flow policy asks --------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: FlowBundle) -> Scale:
        return Scale()

    @classmethod
    def uses_cfg(cls, bundle: FlowBundle) -> bool:
        return not bool(getattr(bundle.transformer.config, "guidance_embeds", False))

    @classmethod
    @no_grad
    def encode_prompt(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, ...]:
        """1.0: (embeds (L, D), mask (L,), pooled (P,)); 1.5: (embeds, mask, glyph embeds (L2, D2), glyph mask)."""
        s, t, device = bundle.settings, bundle.text, bundle.device
        one_five = s["version"] == "1.5"
        ids, mask = ids_and_mask(t["tokenizer"], s["template"].format(text if text or not one_five else " "),
                                 s["text_length"] + s["prefix"], add_special_tokens=not one_five)
        hidden = t["text_encoder"](input_ids=ids.to(device), attention_mask=mask.to(device),
                                   output_hidden_states=True).hidden_states[-(SKIP_LAYERS + 1)][0]
        embeds, mask = hidden[s["prefix"]:].to(bundle.dtype), mask[0, s["prefix"]:].to(device)
        if not one_five:
            clip_ids, _ = ids_and_mask(t["tokenizer_2"], text, t["tokenizer_2"].model_max_length)
            return embeds, mask, t["text_encoder_2"](clip_ids.to(device)).pooler_output[0].to(bundle.dtype)
        return (embeds, mask, *cls._glyphs(bundle, text))

    @classmethod
    def _glyphs(cls, bundle: FlowBundle, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """ByT5 embedding of the prompt's quoted text ('Text "..."', as the pipeline writes it), or zeros."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        length, encoder = bundle.settings["glyph_length"], bundle.text["text_encoder_2"]
        quoted = list(dict.fromkeys(a or b for a, b in QUOTED.findall(text)))
        if not quoted:
            return (torch.zeros(length, encoder.config.d_model, device=bundle.device, dtype=bundle.dtype),
                    torch.zeros(length, dtype=torch.long, device=bundle.device))
        glyph = ". ".join(f'Text "{q}"' for q in quoted) + ". "
        ids, mask = ids_and_mask(bundle.text["tokenizer_2"], glyph, length)
        out = encoder(input_ids=ids.to(bundle.device), attention_mask=mask.float().to(bundle.device))[0][0]
        return out.to(bundle.dtype), mask[0].to(bundle.device)

    @classmethod
    def forward(cls, bundle: FlowBundle, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """The HunyuanVideo transformer on (B, C, F', h, w), float timestep sigma * 1000."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        dtype, timestep = module.dtype, sigma * cls.timestep_scale
        if bundle.settings["version"] == "1.0":
            embeds, mask, pooled = cond
            g = None if guidance is None else torch.full((x.shape[0],), float(guidance) * 1000.0, device=x.device, dtype=dtype)
            out = module(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=embeds.to(dtype),
                         encoder_attention_mask=mask, pooled_projections=pooled.to(dtype), guidance=g, return_dict=False)[0]
            return out.float()
        embeds, mask, glyphs, glyph_mask = cond
        b, _, f, h, w = x.shape
        inputs = torch.cat([x, torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)  # text-to-video: no image condition
        image = x.new_zeros(b, 1, module.config.image_embed_dim)
        out = module(hidden_states=inputs.to(dtype), timestep=timestep, encoder_hidden_states=embeds.to(dtype),
                     encoder_attention_mask=mask, encoder_hidden_states_2=glyphs.to(dtype), encoder_attention_mask_2=glyph_mask,
                     image_embeds=image.to(dtype), return_dict=False)[0]
        return out.float()

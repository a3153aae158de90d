"""The `transfusion` family: a small unified (text + image) transformer of our own in the
Transfusion / BAGEL pattern (its architecture: stages/models/modules/transfusion.py, imported when a
model is built or loaded), one set of weights that is both a causal language model and a
flow-matching velocity model, so a unified family can be tested end to end without BAGEL or
HunyuanImage-3. This module holds its recipe section and the family, and loads no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.flow_family import FlowBundle, FlowFamily, FlowModelBase
from unirl.stages.models.flow_folder import config_of, folder_defaults, write_defaults, write_folder, write_index
from unirl.stages.models.flow_geometry import FlowGeometry, check_image_side
from unirl.stages.models.flow_text import build_tiny_tokenizer, ids_and_mask, seeded, toy_words
from unirl.stages.models.flow_vae import ShiftScale
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.tokenizer import build_char_tokenizer

if TYPE_CHECKING:
    import torch


# A unified family: the one `TransfusionModel` is both the text policy (its LM head, sampled with a
# KV cache like any causal LM) and the flow policy (its velocity head, conditioned on text tokens
# run through the same blocks), so `policies` offers both on the same parameters. Its folder is a
# diffusers-style layout: `transformer/` (the model, config.json + model.safetensors), `vae/` (an
# AutoencoderKL), `tokenizer/` (characters), model_index.json naming `UnirlTransfusionPipeline`.
PIPELINE = "UnirlTransfusionPipeline"
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 "


class TinyTransfusion(Section):
    """Architecture of the seeded random unified model used when `model.path` is empty."""

    image_size: int = Field(32, ge=8, description="Side of generated images in pixels.")
    seed: int = Field(0, description="Seed of the random initialisation.")
    hidden_size: int = Field(64, ge=8, description="Width of the shared transformer.")
    num_layers: int = Field(2, ge=1, description="Transformer blocks (shared by text and image).")
    num_heads: int = Field(4, ge=1, description="Attention heads per block.")
    intermediate_size: int = Field(128, ge=8, description="Width of the SwiGLU MLP.")
    patch_size: int = Field(2, ge=1, description="Image patch side, in latent pixels.")
    latent_channels: int = Field(4, ge=1, description="Channels of the VAE latent.")
    vae_channels: list[int] = Field([32, 32], min_length=1, description="VAE block widths (multiples of 8); the VAE "
                                     "downsamples by 2**(len-1).")
    max_text_len: int = Field(64, ge=4, description="Longest text (prompt + plan) the position table covers.")
    text_length: int = Field(24, ge=2, description="Text tokens of a drawing's condition (the plan, padded).")
    charset: str = Field(CHARSET, min_length=1, description="Characters of the character-level tokenizer.")
    vocabulary: Literal["characters", "words"] = Field(
        "characters", description="characters: one token per character of `charset`; words: one token per word of the "
        "toy tasks and their paraphrases (other words fall apart into characters), as a real tokenizer makes "
        "'red' one token.")

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @model_validator(mode="after")
    def _check_sizes(self) -> TinyTransfusion:
        bad = [c for c in self.vae_channels if c % 8]
        if bad:
            raise ValueError(f"model.tiny.vae_channels: {bad} are not multiples of 8 (the VAE's GroupNorm has 8 groups)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.tiny.hidden_size: {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.text_length > self.max_text_len:
            raise ValueError(f"model.tiny.text_length: {self.text_length} exceeds max_text_len {self.max_text_len}")
        check_image_side("model.tiny.image_size", self.image_size, self.vae_factor, self.patch_size)
        return self


class TransfusionModelConfig(FlowModelBase):
    """A unified model of our own (stages/models/transfusion.py): one transformer that writes text
    and draws images; a local folder in its layout, or the tiny seeded one."""

    kind: Literal["transfusion"] = "transfusion"
    tiny: TinyTransfusion = Field(default_factory=TinyTransfusion, description="Tiny architecture, used only without `path`.")
    chat_template: bool | None = Field(False, description="Wrap text prompts in the tokenizer's chat template (it has none).")


@dataclass
class TransfusionBundle(FlowBundle):
    """A loaded unified model: the flow bundle, and its tokenizer for the text policy."""

    @property
    def tokenizer(self) -> Any:
        return self.text["tokenizer"]


def transfusion_geometry(vae: dict[str, Any], transformer: dict[str, Any], where: str) -> FlowGeometry:
    factor = 2 ** (len(vae.get("block_out_channels", (32,))) - 1)
    p = int(transformer["patch_size"])
    return FlowGeometry(channels=int(transformer["latent_channels"]), spatial=factor, patch=p,
                        max_patches=int(transformer["image_size"]) // p, what=f"the unified model in {where}")


@families.register("transfusion")
class Transfusion(FlowFamily):
    name = "transfusion"
    config = TransfusionModelConfig
    policy = "flow"
    policies = ("text", "flow")
    produces = ("image",)
    pipelines = (PIPELINE,)
    block_lists = ("blocks",)
    timestep_scale = 1.0
    pipeline_defaults = {"image_size": 32, "num_frames": None, "text_length": 24}
    modules = ("diffusers.models.autoencoders.autoencoder_kl",)

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.model.lora is not None:
            raise ValueError("model.lora: the transfusion family trains all its weights (LoRA is not offered); remove it")
        if recipe.rollout.kind == "flow":
            super().check(recipe)

    @classmethod
    def recipe_geometry(cls, cfg: TransfusionModelConfig) -> FlowGeometry | None:
        if cfg.path:
            if not (Path(cfg.path) / "vae" / "config.json").is_file():
                return None
            return transfusion_geometry(config_of(Path(cfg.path), "vae"), config_of(Path(cfg.path), "transformer"), cfg.path)
        t = cfg.tiny
        return transfusion_geometry({"block_out_channels": t.vae_channels},
                                    {"patch_size": t.patch_size, "latent_channels": t.latent_channels,
                                     "image_size": t.image_size // t.vae_factor}, "model.tiny")

    @classmethod
    def tiny_defaults(cls, tiny: Any) -> dict[str, Any]:
        return {"image_size": tiny.image_size, "num_frames": None, "text_length": tiny.text_length}

    @classmethod
    def build_tiny(cls, directory: Path, tiny: TinyTransfusion) -> Path:
        from diffusers import AutoencoderKL  # start-up time: diffusers loads on first use, not when a recipe is read

        from unirl.stages.models.modules.transfusion import build_tiny_transfusion  # start-up time: it loads torch

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        if tiny.vocabulary == "words":
            from unirl.stages.toys.geneval.paraphrase import lexicon  # start-up time: loaded on first use

            tok = build_tiny_tokenizer((*toy_words(), *lexicon()), model_max_length=tiny.max_text_len)
        else:
            tok = build_char_tokenizer(tiny.charset)
        tok.save_pretrained(root / "tokenizer")
        blocks = len(tiny.vae_channels)
        vae = {"in_channels": 3, "out_channels": 3, "latent_channels": tiny.latent_channels,
               "down_block_types": ["DownEncoderBlock2D"] * blocks, "up_block_types": ["UpDecoderBlock2D"] * blocks,
               "block_out_channels": list(tiny.vae_channels), "layers_per_block": 1, "norm_num_groups": 8,
               "sample_size": tiny.image_size, "use_quant_conv": False, "use_post_quant_conv": False,
               "mid_block_add_attention": False, "scaling_factor": 1.0, "shift_factor": 0.0}
        seeded(tiny.seed * 100 + 1, lambda: AutoencoderKL(**vae)).save_pretrained(root / "vae")
        build_tiny_transfusion(root / "transformer", seed=tiny.seed * 100 + 2, vocab_size=len(tok),
                               hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                               intermediate_size=tiny.intermediate_size, latent_channels=tiny.latent_channels,
                               image_size=tiny.image_size // tiny.vae_factor, patch_size=tiny.patch_size,
                               max_text_len=tiny.max_text_len, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
        write_index(root, PIPELINE, {"vae": ("diffusers", "AutoencoderKL"),
                                     "tokenizer": ("transformers", "PreTrainedTokenizerFast"),
                                     "transformer": ("unirl.stages.models.modules.transfusion", "TransfusionModel")})
        write_defaults(root, **cls.tiny_defaults(tiny))
        return root

    @classmethod
    def load(cls, directory: Path, cfg: TransfusionModelConfig, device: Any) -> TransfusionBundle:
        parts = cls.load_parts(directory, cfg, device, text=("tokenizer",))
        (transformer,) = parts.transformers
        geo = transfusion_geometry(dict(parts.vae.config), transformer.config.to_dict(), str(parts.root))
        settings = folder_defaults(parts.root, cls.pipeline_defaults)
        if int(settings["text_length"]) > transformer.config.max_text_len:
            raise ValueError(f"model.path: {parts.root} conditions drawings on {settings['text_length']} text tokens, more "
                             f"than its transformer's max_text_len {transformer.config.max_text_len}")
        return TransfusionBundle(transformer, parts.vae, parts.text, parts.root, parts.index, geo, settings)

    @classmethod
    def codec(cls, bundle: Any) -> Any:
        return ShiftScale()

    @classmethod
    def encode_prompt(cls, bundle: Any, text: str) -> tuple[torch.Tensor, ...]:
        """(ids (L,), mask (L,)): the plan's characters, right-padded to the folder's text_length;
        the transformer reads them itself (no separate text encoder)."""
        ids, mask = ids_and_mask(bundle.tokenizer, text, int(bundle.settings["text_length"]), add_special_tokens=False)
        return ids[0], mask[0]

    @classmethod
    def forward(cls, bundle: Any, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """The shared transformer over [plan tokens | image patches]; the velocity head's output."""
        ids, mask = cond
        return module.velocity(ids.to(x.device).long(), mask.to(x.device), x, sigma).float()

    @classmethod
    def export(cls, bundle: Any, local: Path, state: dict[str, Any], *, lora: Any) -> None:
        """The folder with the trained transformer (model.safetensors, as `from_pretrained` reads it)."""
        from safetensors.torch import save_file  # start-up time: safetensors loads on first use, not when a recipe is read

        write_folder(local, base_dir=bundle.directory, vae=bundle.vae, parts={})
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
        save_file(tensors, str(local / "transformer" / "model.safetensors"), metadata={"format": "pt"})


_MOVED = ("TransfusionConfig", "TransfusionModel", "TransfusionOutput", "build_tiny_transfusion", "joint_attention_mask",
          "patchify", "unpatchify")


def __getattr__(name: str) -> Any:
    """The architecture's names, from stages/models/modules/transfusion.py on first use (a model folder
    saved before the split names this module in model_index.json)."""
    if name in _MOVED:
        from unirl.stages.models.modules import transfusion as transfusion_model  # start-up time: torch on first use

        return getattr(transfusion_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

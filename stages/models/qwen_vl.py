"""What the Qwen-VL families (`qwen2_5_vl`, `qwen3_vl`) share: a vision-language model
(transformers' *ForConditionalGeneration: a vision tower whose merged patch features replace the
image placeholder tokens of the prompt, then a decoder-only language model) run as the
autoregressive `text` policy, its prompts conditioned on images (stages/runtime/images.py).

Each family file supplies its model class and how its tiny seeded config is built; this base
loads a local Hugging Face folder (config.json, safetensors, tokenizer, preprocessor_config.json)
or saves the tiny model in that layout first, so tests and real checkpoints go through one path.

Training options: the vision tower is frozen by default (`model.train_vision`), LoRA adapters go
on the language model's linear layers only, FSDP2 shards each decoder layer (and each vision
block when the tower trains).
"""
from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.family import Family
from unirl.stages.models.qwen3 import check_model_dir
from unirl.stages.models.qwen_vl_prompts import (
    QWEN_SPECIALS,
    ImagePrompts,
    build_vl_tokenizer,
    grid_of,
    image_processor,
    load_image_processor,
    load_vl_tokenizer,
)
from unirl.stages.runtime.config_base import LoraConfig, Section
from unirl.stages.runtime.registry import sources
from unirl.stages.runtime.tokenizer import CHARSET


class TinyVLText(Section):
    """The tiny model's language model."""

    hidden_size: int = Field(64, ge=8, description="Width of the residual stream (the vision tower projects to it).")
    num_hidden_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads; head width is hidden_size / heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(512, ge=16, description="Largest position the model takes.")

    @model_validator(mode="after")
    def _heads_divide(self) -> Any:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide num_attention_heads "
                             f"({self.num_attention_heads}); each key/value head serves a whole group of query heads")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads: {self.num_attention_heads} does not divide hidden_size ({self.hidden_size})")
        return self


class TinyVLVision(Section):
    """The tiny model's vision tower and image processor."""

    depth: int = Field(2, ge=1, description="Vision transformer blocks.")
    hidden_size: int = Field(32, ge=8, description="Width of the vision tower.")
    num_heads: int = Field(2, ge=1, description="Attention heads of the vision tower.")
    intermediate_size: int = Field(64, ge=8, description="MLP width of the vision tower.")
    patch_size: int = Field(4, ge=1, description="Side of a patch in pixels.")
    spatial_merge_size: int = Field(2, ge=1, description="merge x merge patches become one image token.")
    min_pixels: int = Field(16 * 16, ge=1, description="Images smaller than this (width x height) are scaled up.")
    max_pixels: int = Field(64 * 64, ge=1, description="Images larger than this are scaled down.")


class TinyVL(Section):
    """Architecture of the seeded random model used when `model.path` is empty (tests, smoke runs)."""

    text: TinyVLText = Field(default_factory=TinyVLText, description="Language model.")
    vision: TinyVLVision = Field(default_factory=TinyVLVision, description="Vision tower and image processor.")
    seed: int = Field(0, ge=0, description="Seed of the random initialisation.")
    charset: str = Field(CHARSET, min_length=1, description="Characters of the tiny model's character-level tokenizer.")


class VLModelConfig(Section):
    """A Qwen-VL vision-language model; the family files add `kind`."""

    path: str | None = Field(
        None, description="Local directory in Hugging Face layout (config.json, *.safetensors, tokenizer, "
        "preprocessor_config.json). Empty: build the tiny seeded model below.")
    tiny: TinyVL = Field(default_factory=TinyVL, description="Tiny architecture, used only without `path`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the policy.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (peft) on the language model instead of all weights.")
    chat_template: bool | None = Field(
        None, description="Wrap prompts in the tokenizer's chat template (empty: when the tokenizer has one).")
    train_vision: bool = Field(False, description="Train the vision tower too; false: it stays as loaded, frozen, "
                                                  "and only the language model trains.")


@dataclass
class VLBundle:
    """A vision-language model (`module`, what trains), its tokenizer and image processor, its
    config (image token ids) and its M-RoPE position function, loaded from `directory`."""

    module: Any
    tokenizer: Any
    processor: Any
    config: Any
    rope_index: Callable[..., Any]
    directory: Path
    train_vision: bool


def mrope_section(head_dim: int, shares: tuple[int, int, int]) -> list[int]:
    """Split the head's head_dim / 2 rotary frequencies over (time, height, width) in the
    proportions of the real model (`shares`, e.g. 16:24:24 for Qwen2.5-VL)."""
    pairs = head_dim // 2
    height = max(1, round(pairs * shares[1] / sum(shares)))
    width = max(1, round(pairs * shares[2] / sum(shares)))
    return [pairs - height - width, height, width]


def check_vl_dir(directory: str | Path) -> Path:
    d = check_model_dir(directory)
    if not (d / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"model.path {d}: no preprocessor_config.json (a vision-language model folder ships "
                                "its image processor's settings)")
    return d


_PROCESSORS: dict[tuple[Any, ...], Any] = {}


class QwenVL(Family):
    """The shared family code; a family file supplies `model_class` and `tiny_config`."""

    policy = "text"
    produces = ("text", "image")  # the response, and the prompt's first image for scorers that look (vlm_judge)
    takes_images = True
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @classmethod
    def model_class(cls) -> Any:
        raise NotImplementedError

    @classmethod
    def tiny_config(cls, tiny: TinyVL, vocab_size: int, ids: dict[str, int]) -> Any:
        """The transformers config of the tiny model (`ids`: special token -> id)."""
        raise NotImplementedError

    # -- recipe rules ---------------------------------------------------------------------------
    @classmethod
    def check(cls, recipe: Any) -> None:
        if not sources.get(recipe.data.name).gives_images(recipe.data):
            raise ValueError(f"data.name: model.kind {recipe.model.kind!r} answers questions about images, and "
                             f"{recipe.data.name!r} prompts carry none (use data.name toy_vqa, or file with image_column)")
        if recipe.sft is not None and recipe.sft.source == "file":
            raise ValueError("sft.source: a vision-language warm start reads its images with the prompts: use "
                             "`synthetic` (the data source's reference answers) with data.name file and image_column")

    # -- the folder a run starts from ------------------------------------------------------------
    @classmethod
    def materialize(cls, cfg: VLModelConfig, scratch: Path) -> Path:
        return check_vl_dir(cfg.path) if cfg.path else cls.save_tiny(scratch, cfg.tiny)

    @classmethod
    def save_tiny(cls, directory: str | Path, tiny: TinyVL) -> Path:
        """The seeded tiny model, its character tokenizer and its image processor in HF layout."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        directory = Path(directory)
        tok = build_vl_tokenizer(tiny.charset)
        ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIALS}
        config = cls.tiny_config(tiny, len(tok), ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tiny.seed)
            model = cls.model_class()(config)
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(directory, safe_serialization=True)
        tok.save_pretrained(directory)
        cls.processor_for(tiny).save_pretrained(directory)
        return directory

    @classmethod
    def processor_for(cls, tiny: TinyVL) -> Any:
        v = tiny.vision
        return image_processor(v.patch_size, v.spatial_merge_size, 2, v.min_pixels, v.max_pixels)

    @classmethod
    def image_grids(cls, cfg: VLModelConfig, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(t, h, w) patches of an image of each (width, height), as the model's image processor
        cuts it (the folder's settings, or the tiny model's)."""
        key = (cfg.path, cfg.tiny.vision.model_dump_json()) if not cfg.path else (cfg.path,)
        if key not in _PROCESSORS:
            _PROCESSORS[key] = load_image_processor(Path(cfg.path)) if cfg.path else cls.processor_for(cfg.tiny)
        return [grid_of(_PROCESSORS[key], width, height) for width, height in sizes]

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: Path, cfg: VLModelConfig, device: Any) -> VLBundle:
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        d = check_vl_dir(directory)
        model = cls.model_class().from_pretrained(str(d), dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa")
        return cls._bundle(model, d, cfg)

    @classmethod
    def _bundle(cls, model: Any, directory: Path, cfg: VLModelConfig) -> VLBundle:
        model.config.use_cache = False
        if not cfg.train_vision:
            model.model.visual.requires_grad_(False)
        return VLBundle(model, load_vl_tokenizer(directory), load_image_processor(directory), model.config,
                        model.model.get_rope_index, directory, cfg.train_vision)

    @classmethod
    def load_empty(cls, directory: Path, cfg: VLModelConfig, device: Any) -> VLBundle | None:
        """The architecture on the meta device, when the folder's safetensors hold the weights
        under the module's own names (our exports do; a checkpoint in transformers' older layout,
        as Qwen2.5-VL's `save_pretrained` writes it, is loaded whole, which renames on the way)."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from accelerate import init_empty_weights  # start-up time: accelerate loads on first use, not when a recipe is read
        from transformers import AutoConfig  # start-up time: transformers loads on first use, not when a recipe is read

        from unirl.stages.train.shards import SafetensorsRows  # start-up time: it loads torch

        d = check_vl_dir(directory)
        files = cls.weight_files(d)
        if not files:
            return None
        config = AutoConfig.from_pretrained(str(d))
        with init_empty_weights(include_buffers=False):
            model = cls.model_class()._from_config(config, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa")
        stored: set[str] = set()
        for path in files:
            reader = SafetensorsRows(path)
            stored |= set(reader.keys())
            reader.close()
        names = {n for n, _ in model.named_parameters()}
        if not names <= stored:
            return None
        model.tie_weights()
        model.eval()
        return cls._bundle(model, d, cfg)

    @classmethod
    def text_geometry(cls, cfg: VLModelConfig) -> dict[str, Any]:
        """The language model's architecture and the vision tower's parameters, from the folder's
        config.json (or the tiny model's), the model built on the meta device."""
        from accelerate import init_empty_weights  # start-up time: accelerate loads on first use, not when a recipe is read
        from transformers import AutoConfig  # start-up time: transformers loads on first use, not when a recipe is read

        with tempfile.TemporaryDirectory() as scratch:
            try:
                config = AutoConfig.from_pretrained(str(cls.materialize(cfg, Path(scratch))))
            except (OSError, ValueError) as exc:
                raise ValueError(f"model.path: {cfg.path}: no vision-language config.json to read the architecture from "
                                 f"({type(exc).__name__}: {exc})") from exc
        with init_empty_weights(include_buffers=True):
            model = cls.model_class()._from_config(config)
        model.tie_weights()
        text = config.text_config
        heads = int(text.num_attention_heads)
        layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        return {"vocab": int(text.vocab_size), "hidden": int(text.hidden_size), "layers": int(text.num_hidden_layers),
                "heads": heads, "kv_heads": int(text.num_key_value_heads or heads),
                "head_dim": int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                "intermediate": int(text.intermediate_size), "tied": bool(getattr(config, "tie_word_embeddings", False)),
                "qk_norm": hasattr(layer.self_attn, "q_norm"), "qkv_bias": layer.self_attn.q_proj.bias is not None,
                "vision": sum(p.numel() for p in model.model.visual.parameters()), "vision_trained": cfg.train_vision}

    @classmethod
    def weight_files(cls, directory: Path) -> list[Path]:
        return sorted(Path(directory).glob("*.safetensors"))

    # -- training ---------------------------------------------------------------------------------
    @classmethod
    def fsdp_units(cls, module: Any) -> list[Any]:
        """Decoder layers, and the vision blocks when they train (a frozen tower stays in the root
        unit: its blocks are gathered with it, whether or not a rank's batch has images)."""
        layers = [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]
        blocks = [m for m in module.modules() if type(m).__name__.endswith("VisionBlock")
                  and any(p.requires_grad for p in m.parameters())]
        return layers + blocks

    @classmethod
    def add_lora(cls, bundle: VLBundle, lora: LoraConfig) -> None:
        """peft LoRA on the language model's linear layers named by `target_modules` (the vision
        tower's MLP has layers of the same names: it keeps its own weights)."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from peft import LoraConfig as PeftLora  # start-up time: peft loads on first use, not when a recipe is read
        from peft import get_peft_model

        targets = lora.target_modules or list(cls.lora_targets)
        linear = [n for n, m in bundle.module.named_modules() if isinstance(m, torch.nn.Linear) and ".language_model." in f".{n}"]
        pattern = rf"(.*\.)?language_model\..*\.({'|'.join(re.escape(t) for t in targets)})"
        if not any(re.fullmatch(pattern, n) for n in linear):
            names = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(f"model.lora.target_modules {targets} match no linear layer of the language model "
                             f"(available: {', '.join(names)})")
        peft = PeftLora(r=lora.rank, lora_alpha=lora.alpha, target_modules=pattern, lora_dropout=0.0)  # type: ignore[arg-type]
        bundle.module = get_peft_model(bundle.module, peft)
        if bundle.train_vision:
            bundle.module.get_base_model().model.visual.requires_grad_(True)

    @classmethod
    @contextmanager
    def reference(cls, bundle: VLBundle) -> Iterator[Any]:
        with bundle.module.disable_adapter():
            yield bundle.module

    @classmethod
    def export(cls, bundle: VLBundle, local: Path, state: dict[str, Any], *, lora: LoraConfig | None) -> None:
        """model.safetensors under the module's names (LoRA merged: W + B A * alpha / r), config,
        generation config, tokenizer (with its chat template) and image processor settings."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from safetensors.torch import save_file  # start-up time: safetensors loads on first use, not when a recipe is read

        local.mkdir(parents=True, exist_ok=True)
        module = bundle.module
        if lora is not None:
            base = cls.model_class().from_pretrained(str(bundle.directory), attn_implementation="sdpa")
            merged = VLBundle(base, bundle.tokenizer, bundle.processor, base.config, base.model.get_rope_index,
                              bundle.directory, bundle.train_vision)
            with torch.random.fork_rng(devices=[]):  # its random adapters are overwritten below
                cls.add_lora(merged, lora)
            _, unexpected = merged.module.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"LoRA export: unexpected keys {unexpected[:3]}")
            module = bundle.module.get_base_model()
            state = merged.module.merge_and_unload().state_dict()
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(local / "model.safetensors"), metadata={"format": "pt"})
        module.config.save_pretrained(local)
        module.generation_config.save_pretrained(local)
        bundle.tokenizer.save_pretrained(local)
        bundle.processor.save_pretrained(local)

    # -- what the text policy asks of a family whose prompts carry images ------------------------
    @classmethod
    def image_prompts(cls, bundle: VLBundle, use_chat: bool, device: Any) -> Any:
        return ImagePrompts(bundle, use_chat, device)

    @classmethod
    def prompt_encoder(cls, directory: Path, chat_template: bool | None) -> Any:
        return ImagePrompts.from_folder(check_vl_dir(directory), chat_template)

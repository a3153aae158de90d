"""The `qwen3` family: Qwen3ForCausalLM, built from a tiny seeded config or loaded from a local HF
directory, run as the autoregressive text policy.

The tiny model is saved in HF layout first (`save_tiny_qwen3`) and then loaded by path, so tests
and smoke runs go through the same loading code as real checkpoints.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.family import Family
from unirl.stages.runtime.config_base import LoraConfig, Section
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.tokenizer import SPECIAL, build_char_tokenizer, load_tokenizer

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class TinyQwen3(Section):
    """Architecture of the seeded random model used when `model.path` is empty (tests, smoke runs)."""

    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    num_hidden_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int = Field(16, ge=4, description="Per-head width.")
    intermediate_size: int = Field(128, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(256, ge=16, description="Longest sequence the model takes.")
    seed: int = Field(0, ge=0, description="Seed of the random initialisation.")
    charset: str = Field(
        "0123456789+-*=() ", min_length=1, description="Characters of the tiny model's character-level tokenizer."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> Any:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide num_attention_heads "
                             f"({self.num_attention_heads}); each key/value head serves a whole group of query heads")
        return self


class Qwen3ModelConfig(Section):
    """A Qwen3-architecture causal language model (transformers Qwen3ForCausalLM)."""

    kind: Literal["qwen3"] = Field("qwen3", description="Model family.")
    path: str | None = Field(
        None,
        description="Local directory in Hugging Face layout (config.json, *.safetensors, tokenizer). "
        "Empty: build the tiny seeded model below.",
    )
    tiny: TinyQwen3 = Field(default_factory=TinyQwen3, description="Tiny architecture, used only without `path`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the policy.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (peft) instead of all weights.")
    chat_template: bool | None = Field(
        None, description="Wrap prompts in the tokenizer's chat template (empty: when the tokenizer has one)."
    )


@dataclass
class TextBundle:
    """A causal language model (`module`, what trains) and its tokenizer, loaded from `directory`."""

    module: Any
    tokenizer: Any
    directory: Path


def tiny_qwen3_config(tiny: Any, vocab_size: int, eos_token_id: int, pad_token_id: int, bos_token_id: int):
    from transformers import Qwen3Config  # start-up time: transformers loads on first use, not when a recipe is read

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
    )


def save_tiny_qwen3(directory: str | Path, tiny: Any) -> Path:
    """Build the seeded tiny model and its character tokenizer and save both in HF layout."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    from transformers import Qwen3ForCausalLM  # start-up time: transformers loads on first use, not when a recipe is read

    directory = Path(directory)
    tok = build_char_tokenizer(tiny.charset)
    config = tiny_qwen3_config(tiny, len(tok), tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def check_model_dir(directory: str | Path) -> Path:
    """Fail early, naming the directory, when it cannot be a model."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"model.path {d}: no such directory (give a local Hugging Face model folder)")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"model.path {d}: no config.json (expected a Hugging Face model folder)")
    if not any(any(d.glob(p)) for p in WEIGHT_PATTERNS):
        raise FileNotFoundError(f"model.path {d}: no weights (*.safetensors or *.bin) in the folder")
    return d


def load_qwen3(directory: str | Path, *, dtype: str = "float32"):
    """(model, tokenizer) from a local HF directory, in train mode, no dropout."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    from transformers import AutoModelForCausalLM  # start-up time: transformers loads on first use, not when a recipe is read

    d = check_model_dir(directory)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.config.use_cache = False
    return model, load_tokenizer(d)


@families.register("qwen3")
class Qwen3(Family):
    name = "qwen3"
    config = Qwen3ModelConfig
    policy = "text"
    produces = ("text",)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    modules = ("transformers.models.qwen3.modeling_qwen3", "peft")
    serves_tensors = True

    @classmethod
    def materialize(cls, cfg: Qwen3ModelConfig, scratch: Path) -> Path:
        return check_model_dir(cfg.path) if cfg.path else save_tiny_qwen3(scratch, cfg.tiny)

    @classmethod
    def load(cls, directory: Path, cfg: Qwen3ModelConfig, device: Any) -> TextBundle:
        model, tokenizer = load_qwen3(directory, dtype=cfg.dtype)
        return TextBundle(model, tokenizer, Path(directory))

    @classmethod
    def load_empty(cls, directory: Path, cfg: Qwen3ModelConfig, device: Any) -> TextBundle | None:
        """The architecture from config.json on the meta device (rotary buffers computed for real)."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from accelerate import init_empty_weights  # start-up time: accelerate loads on first use, not when a recipe is read
        from transformers import AutoConfig, AutoModelForCausalLM  # start-up time: transformers loads on first use, not when a recipe is read

        d = check_model_dir(directory)
        if not cls.weight_files(d):
            return None
        config = AutoConfig.from_pretrained(str(d))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa")
        model.tie_weights()  # from_pretrained ties lm_head to the embedding when the config says so; from_config does not
        model.config.use_cache = False
        model.eval()  # as from_pretrained leaves it
        return TextBundle(model, load_tokenizer(d), d)

    @classmethod
    def weight_files(cls, directory: Path) -> list[Path]:
        return sorted(Path(directory).glob("*.safetensors"))

    @classmethod
    def fsdp_units(cls, module: Any) -> list[Any]:
        return [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]

    @classmethod
    def text_geometry(cls, cfg: Qwen3ModelConfig) -> dict[str, Any]:
        """The architecture of `model.path`'s config.json, or of the tiny model."""
        if cfg.path:
            path = Path(cfg.path) / "config.json"
            try:
                data = json.loads(path.read_bytes()[: 1 << 20])
                heads = int(data["num_attention_heads"])
                return {"vocab": int(data["vocab_size"]), "hidden": int(data["hidden_size"]), "layers": int(data["num_hidden_layers"]),
                        "heads": heads, "kv_heads": int(data.get("num_key_value_heads") or heads),
                        "head_dim": int(data.get("head_dim") or int(data["hidden_size"]) // heads),
                        "intermediate": int(data["intermediate_size"]), "tied": bool(data.get("tie_word_embeddings", False))}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"model.path: {path}: not a Qwen3 config.json to read the architecture from "
                                 f"({type(exc).__name__}: {exc})") from exc
        t = cfg.tiny
        return {"vocab": len(SPECIAL) + len(dict.fromkeys(t.charset)), "hidden": t.hidden_size, "layers": t.num_hidden_layers,
                "heads": t.num_attention_heads, "kv_heads": t.num_key_value_heads, "head_dim": t.head_dim,
                "intermediate": t.intermediate_size, "tied": False}

    @classmethod
    def add_lora(cls, bundle: TextBundle, lora: LoraConfig) -> None:
        """peft LoRA on the linear layers; a target list that matches no layer names what exists."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from peft import LoraConfig as PeftLora  # start-up time: peft loads on first use, not when a recipe is read
        from peft import get_peft_model

        targets = lora.target_modules or list(cls.lora_targets)
        names = {n.rsplit(".", 1)[-1] for n, m in bundle.module.named_modules() if isinstance(m, torch.nn.Linear)}
        if not any(t in names for t in targets):
            raise ValueError(f"model.lora.target_modules {targets} match no linear layer (available: {', '.join(sorted(names))})")
        bundle.module = get_peft_model(bundle.module, PeftLora(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=0.0))  # type: ignore[arg-type]

    @classmethod
    @contextmanager
    def reference(cls, bundle: TextBundle) -> Iterator[Any]:
        with bundle.module.disable_adapter():
            yield bundle.module

    @classmethod
    def served_tensors(cls, bundle: TextBundle, state: dict[str, Any], *, lora: LoraConfig | None) -> dict[str, Any]:
        """`state` under the base model's names (LoRA merged: W + B A * alpha / r)."""
        if lora is None:
            return state
        from unirl.stages.models.flow_lora import merge_lora  # start-up time: torch loads on first use

        prefix = "base_model.model."
        return {k.removeprefix(prefix): v for k, v in merge_lora(state, rank=lora.rank, alpha=lora.alpha).items()}

    @classmethod
    def export(cls, bundle: TextBundle, local: Path, state: dict[str, Any], *, lora: LoraConfig | None) -> None:
        """model.safetensors (LoRA merged: W + B A * alpha / r, in base names), config, tokenizer."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read
        from safetensors.torch import save_file  # start-up time: safetensors loads on first use, not when a recipe is read

        local.mkdir(parents=True, exist_ok=True)
        config = bundle.module.config
        if lora is not None:
            base, _ = load_qwen3(bundle.directory)
            merged = TextBundle(base, bundle.tokenizer, bundle.directory)
            with torch.random.fork_rng(devices=[]):  # its random adapters are overwritten below
                cls.add_lora(merged, lora)
            _, unexpected = merged.module.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"LoRA export: unexpected keys {unexpected[:3]}")
            config = bundle.module.get_base_model().config
            state = merged.module.merge_and_unload().state_dict()
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(local / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(local)
        bundle.tokenizer.save_pretrained(local)

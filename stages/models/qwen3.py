"""Qwen3ForCausalLM: built from a tiny seeded config, or loaded from a local HF directory.

The tiny model is saved in HF layout first (`save_tiny_qwen3`) and then loaded by path, so tests
and smoke runs go through the same loading code as real checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def tiny_qwen3_config(tiny: Any, vocab_size: int, eos_token_id: int, pad_token_id: int, bos_token_id: int):
    from transformers import Qwen3Config

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
    import torch
    from transformers import Qwen3ForCausalLM

    from stages.models.tokenizer import build_char_tokenizer

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
    import torch
    from transformers import AutoModelForCausalLM

    from stages.models.tokenizer import load_tokenizer

    d = check_model_dir(directory)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.config.use_cache = False
    return model, load_tokenizer(d)

"""Model bundles: how each model family is built, saved and loaded from a local directory."""
from stages.models.qwen3 import check_model_dir, load_qwen3, save_tiny_qwen3
from stages.models.tokenizer import build_char_tokenizer, load_tokenizer

__all__ = ["build_char_tokenizer", "check_model_dir", "load_qwen3", "load_tokenizer", "save_tiny_qwen3"]

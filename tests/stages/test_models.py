"""Model bundle: the tiny Qwen3 and its tokenizer go through the same from-directory path as real
checkpoints; chat templates wrap prompts when present; bad folders fail naming the folder."""
from __future__ import annotations

import pytest
import torch

from unirl.stages.models import check_model_dir, load_qwen3, save_tiny_qwen3
from unirl.stages.models.qwen3 import TinyQwen3
from unirl.stages.runtime.tokenizer import build_char_tokenizer, encode_prompt, uses_chat_template


def test_tiny_model_saves_and_loads_by_path_deterministically(tmp_path):
    a = save_tiny_qwen3(tmp_path / "a", TinyQwen3(seed=3))
    b = save_tiny_qwen3(tmp_path / "b", TinyQwen3(seed=3))
    model_a, tok = load_qwen3(a)
    model_b, _ = load_qwen3(b)
    assert type(model_a).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([tok("1+2=", add_special_tokens=False).input_ids])
    assert torch.equal(model_a(input_ids=ids).logits, model_b(input_ids=ids).logits)
    assert tok.decode(tok("12+3=", add_special_tokens=False).input_ids) == "12+3="
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_chat_template_wraps_prompts_when_present(tmp_path):
    tok = build_char_tokenizer("0123456789+=<>|/ abcdefghijklmnopqrstuvwxyz")
    assert not uses_chat_template(tok, None)
    assert encode_prompt(tok, "1+2=", False) == tok("1+2=", add_special_tokens=False).input_ids
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    tok.save_pretrained(tmp_path)
    from unirl.stages.models import load_tokenizer

    loaded = load_tokenizer(tmp_path)
    assert uses_chat_template(loaded, None)
    assert loaded.decode(encode_prompt(loaded, "1+2=", True)) == "<|user|>1+2=<|assistant|>"
    assert not uses_chat_template(loaded, False)
    with pytest.raises(ValueError, match="has no chat template"):
        uses_chat_template(build_char_tokenizer(), True)


def test_bad_model_folders_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_model_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}: no weights"):
        check_model_dir(tmp_path)

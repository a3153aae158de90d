"""A character-level tokenizer built in code and saved in Hugging Face layout (tokenizer.json), so
the tiny models load through `AutoTokenizer.from_pretrained(dir)` exactly like real checkpoints."""
from __future__ import annotations

from pathlib import Path

CHARSET = "0123456789+-*/=()., abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:?!'\"\n<>{}\\_^"
SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")


def build_char_tokenizer(charset: str = CHARSET, vocab_size: int | None = None):
    """A `PreTrainedTokenizerFast` with one token per character plus <pad>/<eos>/<bos>/<unk>;
    with `vocab_size`, filler tokens `<|tN|>` up to that size (text never encodes to them; a model of
    a released vocabulary's size samples them, and they decode as written)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # start-up time: tokenizers loads on first use, not when a recipe is read
    from transformers import PreTrainedTokenizerFast  # start-up time: transformers loads on first use, not when a recipe is read

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in dict.fromkeys(charset):
        vocab[ch] = len(vocab)
    for n in range(len(vocab), vocab_size or 0):
        vocab[f"<|t{n}|>"] = n
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def load_tokenizer(directory: str | Path):
    """Load a tokenizer from a local HF directory; pad falls back to eos (Qwen3 checkpoints)."""
    from transformers import AutoTokenizer  # start-up time: transformers loads on first use, not when a recipe is read

    tok = AutoTokenizer.from_pretrained(str(directory))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"{directory}: the tokenizer has no eos token; generation could never finish")
    return tok


def uses_chat_template(tokenizer, setting: bool | None) -> bool:
    """`model.chat_template`: explicit True/False, or None for "when the tokenizer has one"."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting and not has:
        raise ValueError("model.chat_template is true but the tokenizer has no chat template")
    return has if setting is None else setting


def encode_prompt(tokenizer, text: str, use_chat: bool) -> list[int]:
    """Token ids of a user prompt, wrapped in the chat template (with the generation prompt) when
    `use_chat`, else the plain text."""
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids

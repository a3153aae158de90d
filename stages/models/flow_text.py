"""The text side of the flow families: tiny tokenizers and tiny text encoders built in code (seeded;
the same classes a real checkpoint's folder names, so a tiny folder loads through the same
`from_pretrained` path), and the encoding steps their pipelines share: a prompt template whose
prefix is cropped off, padding to a fixed length with an attention mask, a chosen hidden layer.
Every prompt is encoded alone and padded to the same length, so its conditioning is the same bits
in whatever batch it later appears (stages/diffusion/model.py caches it)."""
from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unirl.stages.toys.geneval.dataset import WORDS
from unirl.stages.toys.videotoy.dataset import WORDS as VIDEO_WORDS

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

SPECIALS = ("<pad>", "<unk>", "<eos>", "<bos>")
# Chat-template markers the real templates use (Qwen's, Llama 3's): one token each in the tiny tokenizer.
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|begin_of_text|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def toy_words() -> tuple[str, ...]:
    """The toy tasks' vocabulary (toy GenEval, toy video), one token each in the tiny tokenizer."""
    return tuple(dict.fromkeys((*WORDS, *VIDEO_WORDS)))


def build_tiny_tokenizer(words: Sequence[str] | None = None, *, templates: Sequence[str] = (),
                         model_max_length: int = 512) -> Any:
    """A `PreTrainedTokenizerFast` (WordPiece): each of `words` (default: the toy tasks') and of the
    words in `templates` (a family's prompt templates, so their prefixes stay short) is one token,
    any other word falls apart into characters, the template markers are special tokens; with a
    chat template (Qwen's layout). Deterministic: no training, the same in every process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # start-up time: tokenizers loads on first use, not when a recipe is read
    from transformers import PreTrainedTokenizerFast  # start-up time: transformers loads on first use, not when a recipe is read

    words = toy_words() if words is None else tuple(words)
    words = tuple(dict.fromkeys((*words, "system", "user", "assistant", *(w for t in templates for w in re.findall(r"\w+", t)))))
    vocab: dict[str, int] = {}
    for token in (*SPECIALS, *TEMPLATE_TOKENS, *words, *string.printable.strip(), *("##" + c for c in string.printable.strip())):
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                  bos_token="<bos>", additional_special_tokens=list(TEMPLATE_TOKENS),
                                  model_max_length=model_max_length)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def learn_bpe(words: list[str], alphabet: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE merges learned on `words` until every word is one token (`</w>` marks a word's end):
    each round merges the most frequent adjacent pair, ties broken by the pair itself, so the
    same words give the same vocabulary in every process (the `tokenizers` trainer breaks ties by
    hash order, which changes between processes). The vocabulary: the special tokens, the
    alphabet, each character as a word end, then the merges in order."""
    vocab: dict[str, int] = {}
    for token in ["<|startoftext|>", "<|endoftext|>", *alphabet, *(ch + "</w>" for ch in alphabet)]:
        vocab.setdefault(token, len(vocab))
    counts = Counter(words)
    pieces = {w: [*w[:-1], w[-1] + "</w>"] for w in counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, seq in pieces.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] += counts[w]
        if not pairs:
            return vocab, merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for w, seq in pieces.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            pieces[w] = out


def build_tiny_clip_tokenizer(words: Sequence[str] | None = None, model_max_length: int = 16) -> Any:
    """A CLIP BPE tokenizer (byte-level alphabet, `</w>` word ends) whose merges are learned in code,
    deterministically, on `words` (default: the toy-GenEval vocabulary), so each of those words is
    one token and any other text still tokenizes character by character. Single characters that
    end a word ("a", ",") are in the vocabulary, or they would map to the unknown token, which
    CLIP shares with end-of-text (where the pooled embedding is read)."""
    from tokenizers import pre_tokenizers  # start-up time: tokenizers loads on first use, not when a recipe is read
    from transformers import CLIPTokenizer  # start-up time: transformers loads on first use, not when a recipe is read

    if words is None:
        words = WORDS
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = learn_bpe(list(words), alphabet)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def seeded(seed: int, build: Any) -> Any:
    """`build()` under torch's global RNG seeded with `seed`, the caller's RNG left as it was."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def ids_and_mask(tokenizer: Any, texts: Sequence[str] | str, max_length: int, *,
                 add_special_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (B, max_length), right-padded and truncated; a prompt that loses
    tokens to truncation is logged."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    out = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=add_special_tokens, return_tensors="pt")
    longer = tokenizer(texts, max_length=max_length + 1, truncation=True, add_special_tokens=add_special_tokens).input_ids
    for text, ids in zip(texts, longer):
        if len(ids) > max_length:
            logger.warning("prompt %r has more than %d tokens; %s keeps the first %d (the end is cut)",
                           text[-80:], max_length, type(tokenizer).__name__, max_length)
    return out.input_ids, out.attention_mask


def pad_rows(x: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` rows of a (L, D) sequence and its (L,) mask, zero-padded to `length`."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    x, mask = x[:length], mask[:length]
    if x.shape[0] < length:
        x = torch.cat([x, x.new_zeros(length - x.shape[0], *x.shape[1:])])
        mask = torch.cat([mask, mask.new_zeros(length - mask.shape[0])])
    return x, mask


# ---------------------------------------------------------------------------- tiny encoders


def tiny_qwen3(tokenizer: Any, *, hidden: int, layers: int, seed: int) -> Any:
    """A tiny Qwen3ForCausalLM (FLUX.2 Klein's text encoder class)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # start-up time: transformers loads on first use, not when a recipe is read

    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=1024,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return seeded(seed, lambda: Qwen3ForCausalLM(cfg))


def _qwen25_text(tokenizer: Any, hidden: int, layers: int) -> dict[str, Any]:
    return {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, hidden // 4 - 2]},
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def tiny_qwen25_vl(tokenizer: Any, *, hidden: int, layers: int, seed: int) -> Any:
    """A tiny Qwen2_5_VLForConditionalGeneration (Qwen-Image's text encoder class; its vision tower
    tiny too, unused for text prompts)."""
    # start-up time: transformers loads on first use, not when a recipe is read
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
              "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1, "fullatt_block_indexes": [0]}
    cfg = Qwen2_5_VLConfig(text_config=_qwen25_text(tokenizer, hidden, layers), vision_config=vision)
    return seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(cfg))


def tiny_qwen25_text(tokenizer: Any, *, hidden: int, layers: int, seed: int) -> Any:
    """A tiny Qwen2_5_VLTextModel (HunyuanVideo 1.5's text encoder class)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel  # start-up time: transformers loads on first use, not when a recipe is read

    return seeded(seed, lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**_qwen25_text(tokenizer, hidden, layers))))


def tiny_umt5(tokenizer: Any, *, hidden: int, layers: int, seed: int) -> Any:
    """A tiny UMT5EncoderModel (Wan's text encoder class)."""
    from transformers import UMT5Config, UMT5EncoderModel  # start-up time: transformers loads on first use, not when a recipe is read

    cfg = UMT5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=hidden // 2, d_ff=2 * hidden, num_layers=layers,
                     num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     decoder_start_token_id=tokenizer.pad_token_id)
    return seeded(seed, lambda: UMT5EncoderModel(cfg))


def tiny_llama(tokenizer: Any, *, hidden: int, layers: int, seed: int) -> Any:
    """A tiny LlamaModel (HunyuanVideo 1.0's text encoder class)."""
    from transformers import LlamaConfig, LlamaModel  # start-up time: transformers loads on first use, not when a recipe is read

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return seeded(seed, lambda: LlamaModel(cfg))


def tiny_clip(tokenizer: Any, *, hidden: int, seed: int, projection: bool = True) -> Any:
    """A tiny CLIP text encoder (2 layers, 2 heads, projection `hidden` wide, as many positions as
    the tokenizer's length): CLIPTextModelWithProjection (SD3's CLIP-L and CLIP-G) or, without
    `projection`, CLIPTextModel (HunyuanVideo 1.0's pooled encoder)."""
    # start-up time: transformers loads on first use, not when a recipe is read
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, hidden_size=hidden, intermediate_size=2 * hidden,
                         projection_dim=hidden, num_hidden_layers=2, num_attention_heads=2)
    model = CLIPTextModelWithProjection if projection else CLIPTextModel
    return seeded(seed, lambda: model(cfg))


def tiny_t5(tokenizer: Any, *, hidden: int, seed: int) -> Any:
    """A tiny T5EncoderModel (SD3's third text encoder): one layer, 4 heads, gated-gelu like T5 v1.1, no dropout."""
    from transformers import T5Config, T5EncoderModel  # start-up time: transformers loads on first use, not when a recipe is read

    cfg = T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=1,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    return seeded(seed, lambda: T5EncoderModel(cfg))


def tiny_clip_text(*, hidden: int, seed: int, max_length: int = 16) -> tuple[Any, Any]:
    """A tiny CLIPTextModel and its tokenizer (HunyuanVideo 1.0's pooled text encoder)."""
    tok = build_tiny_clip_tokenizer(toy_words(), model_max_length=max_length)
    return tiny_clip(tok, hidden=hidden, seed=seed, projection=False), tok


def tiny_byt5(*, hidden: int, seed: int) -> tuple[Any, Any]:
    """A tiny T5EncoderModel over ByT5's byte vocabulary and the ByT5 tokenizer (HunyuanVideo 1.5's
    glyph encoder: it reads the quoted text of a prompt)."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel  # start-up time: transformers loads on first use, not when a recipe is read

    tok = ByT5Tokenizer()
    cfg = T5Config(vocab_size=len(tok), d_model=hidden, d_kv=hidden // 2, d_ff=2 * hidden, num_layers=1, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                   dropout_rate=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   decoder_start_token_id=tok.pad_token_id)
    return seeded(seed, lambda: T5EncoderModel(cfg)), tok

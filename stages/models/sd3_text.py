"""SD3's text side: tiny tokenizers and text-encoder configs built in code, and prompt encoding.

SD3 conditions on two CLIP text encoders (CLIP-L, CLIP-G) and one T5. Per prompt:
  embeds (B, L_clip + L_t5, D_joint) = cat_seq(pad_to_D_joint(cat_feat(clip_l[-2], clip_g[-2])), t5)
  pooled (B, P) = cat_feat(clip_l.text_embeds, clip_g.text_embeds)
where clip[-2] is the penultimate hidden state and D_joint = transformer.config.joint_attention_dim.
A checkpoint without T5 gets `max_sequence_length` zero rows instead, as diffusers' pipeline does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from unirl.stages.models.sd3 import SD3Bundle

logger = logging.getLogger(__name__)

# SD3's pipeline default for the T5 sequence (and the zero rows that replace a missing T5).
DEFAULT_T5_LENGTH = 256


def learn_bpe(words: list[str], alphabet: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE merges learned on `words` until every word is one token (`</w>` marks a word's end):
    each round merges the most frequent adjacent pair, ties broken by the pair itself, so the
    same words give the same vocabulary in every process (the `tokenizers` trainer breaks ties by
    hash order, which changes between processes). The vocabulary: the special tokens, the
    alphabet, each character as a word end, then the merges in order."""
    from collections import Counter

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


def build_tiny_tokenizer(words: tuple[str, ...] | None = None, model_max_length: int = 16) -> Any:
    """A CLIP BPE tokenizer (byte-level alphabet, `</w>` word ends) whose merges are learned in code,
    deterministically, on `words` (default: the toy-GenEval vocabulary), so each of those words is
    one token and any other text still tokenizes character by character. Single characters that
    end a word ("a", ",") are in the vocabulary, or they would map to the unknown token, which
    CLIP shares with end-of-text (where the pooled embedding is read)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    if words is None:
        from unirl.stages.toys.geneval.dataset import WORDS

        words = WORDS
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = learn_bpe(list(words), alphabet)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)  # type: ignore[arg-type]


def tiny_clip_config(*, hidden_size: int = 32, projection_dim: int = 32, num_layers: int = 2,
                     num_heads: int = 2) -> dict[str, Any]:
    """CLIPTextConfig kwargs of a tiny CLIP text encoder (vocab and special ids come from the
    tokenizer at build time)."""
    return {
        "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "projection_dim": projection_dim,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
    }


def tiny_t5_config(*, d_model: int = 64, num_layers: int = 1, num_heads: int = 4) -> dict[str, Any]:
    """T5Config kwargs of a tiny T5 encoder (gated-gelu like T5 v1.1, no dropout)."""
    return {
        "d_model": d_model, "d_kv": d_model // num_heads, "d_ff": 2 * d_model, "num_layers": num_layers,
        "num_heads": num_heads, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0,
    }


def build_text_encoder(kind: str, config: dict[str, Any], tokenizer: Any) -> Any:
    """A randomly initialised (seed set by the caller) CLIPTextModelWithProjection or T5EncoderModel."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if kind == "clip":
        cfg = CLIPTextConfig(
            vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
            bos_token_id=tokenizer.bos_token_id, **ids, **config,
        )
        return CLIPTextModelWithProjection(cfg)
    t5 = T5Config(vocab_size=len(tokenizer), decoder_start_token_id=tokenizer.pad_token_id, **ids, **config)  # type: ignore[call-arg]
    return T5EncoderModel(t5)


@dataclass
class PromptEmbeds:
    """embeds (B, L, D_joint), pooled (B, P); the negative pair is None unless a negative prompt
    was given (SD3's default unconditional prompt is the empty string "")."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None


def _token_ids(tokenizer: Any, texts: list[str], max_length: int) -> torch.Tensor:
    ids = tokenizer(
        texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    lengths = [len(x) for x in tokenizer(texts).input_ids]
    for text, n in zip(texts, lengths):
        if n > max_length:
            logger.warning("prompt %r has %d tokens; %s keeps the first %d",
                           text, n, type(tokenizer).__name__, max_length)
    return ids


@torch.no_grad()
def _encode(bundle: SD3Bundle, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    device = bundle.device
    joint_dim = bundle.transformer.config.joint_attention_dim
    clip_length = bundle.tokenizers[0].model_max_length  # both CLIPs use the first one's, as in SD3
    hidden, pooled = [], []
    for encoder, tokenizer in zip(bundle.text_encoders, bundle.tokenizers):
        out = encoder(_token_ids(tokenizer, texts, clip_length).to(device), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    clip = torch.cat(hidden, dim=-1)
    if clip.shape[-1] > joint_dim:
        raise ValueError(
            f"the CLIP encoders in {bundle.directory} give {clip.shape[-1]} features, more than the "
            f"transformer's joint_attention_dim {joint_dim}"
        )
    clip = F.pad(clip, (0, joint_dim - clip.shape[-1]))
    n = bundle.max_sequence_length
    if bundle.t5_encoder is not None:
        t5 = bundle.t5_encoder(_token_ids(bundle.t5_tokenizer, texts, n).to(device))[0]
    else:
        t5 = clip.new_zeros(len(texts), n, joint_dim)
    dtype = bundle.transformer.dtype
    return torch.cat([clip, t5.to(clip.dtype)], dim=1).to(dtype), torch.cat(pooled, dim=-1).to(dtype)


def encode_prompts(bundle: SD3Bundle, prompts: list[str],
                   negative_prompt: str | list[str] | None = None) -> PromptEmbeds:
    """Prompts -> `PromptEmbeds` on the bundle's device, in the transformer's dtype.

    `negative_prompt`: one string for every prompt (encoded once) or one per prompt; None gives
    no negative embeddings (enough for guidance-free sampling)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    embeds, pooled = _encode(bundle, list(prompts))
    if negative_prompt is None:
        return PromptEmbeds(embeds, pooled)
    if isinstance(negative_prompt, str):
        neg, neg_pooled = _encode(bundle, [negative_prompt])
        neg, neg_pooled = neg.expand(len(prompts), -1, -1), neg_pooled.expand(len(prompts), -1)
    else:
        if len(negative_prompt) != len(prompts):
            raise ValueError(f"{len(negative_prompt)} negative prompts for {len(prompts)} prompts")
        neg, neg_pooled = _encode(bundle, list(negative_prompt))
    return PromptEmbeds(embeds, pooled, neg, neg_pooled)

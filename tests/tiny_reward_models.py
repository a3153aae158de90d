"""Tiny random reward models for tests and benchmarks: built from configs (seeded), tokenizers
built in code, saved with save_pretrained so they load through the same local-directory path as
real weights. Their scores are meaningless; their shapes, dtypes and file layout are real.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any


def random_images(n: int, *, size: tuple[int, int] = (48, 40), seed: int = 0) -> list[Any]:
    """n RGB PIL images (width, height = size) of seeded noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def save_tiny_clip(path: str | Path, *, seed: int = 0, head: bool = True) -> Path:
    """A CLIPModel (32-px images, 16-d projections), a CLIP BPE tokenizer over single characters
    and a CLIP image processor; with `head`, also `aesthetic_head.safetensors` (16 -> 8 -> 1)."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = Path(path)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16,
    )
    CLIPModel(config).eval().save_pretrained(path)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits + "!?.,'\"-":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=32).save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    if head:
        g = torch.Generator().manual_seed(seed + 1)
        save_file({
            "layers.0.weight": torch.randn(8, 16, generator=g), "layers.0.bias": torch.randn(8, generator=g),
            "layers.2.weight": torch.randn(1, 8, generator=g), "layers.2.bias": torch.tensor([5.0]),
        }, str(path / "aesthetic_head.safetensors"))
    return path


def save_tiny_ocr(path: str | Path, *, seed: int = 0) -> Path:
    """A VisionEncoderDecoderModel (ViT encoder, TrOCR decoder) with a character tokenizer and a
    ViT image processor. Its output projection is untied and widened so that greedy decoding
    emits characters rather than repeating the start token."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, TrOCRConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    path = Path(path)
    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.ascii_lowercase + string.digits + " "))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    encoder = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        image_size=32, patch_size=8)
    decoder = TrOCRConfig(vocab_size=len(vocab), d_model=32, decoder_layers=1, decoder_attention_heads=2,
                          decoder_ffn_dim=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                          pad_token_id=2, decoder_start_token_id=0, tie_word_embeddings=False)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2
    model = VisionEncoderDecoderModel(config).eval()
    with torch.no_grad():
        model.decoder.output_projection.weight.normal_(0.0, 1.0)
    gen = model.generation_config
    gen.decoder_start_token_id, gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = 0, 0, 1, 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def save_tiny_qwen2_vl(path: str | Path, *, answer: str = "7", seed: int = 0) -> Path:
    """A Qwen2VLForConditionalGeneration whose greedy answer is always the word `answer`, repeated.

    The final norm's weight is zero, so every logit is 0 and greedy decoding picks token id 0,
    which the word-level tokenizer maps to `answer`. The vision tower is random and really runs.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    words = [answer, "<unk>", "user", "assistant", "system", "rate", "the", "image", "prompt", "score"]
    vocab = {w: i for i, w in enumerate(words + [str(d) for d in range(11) if str(d) != answer] + QWEN_SPECIALS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", additional_special_tokens=QWEN_SPECIALS)
    ids = {s: vocab[s] for s in QWEN_SPECIALS}
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.norm.weight.zero_()
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}).save_pretrained(path)
    return path

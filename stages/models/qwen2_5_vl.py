"""The `qwen2_5_vl` family: Qwen2.5-VL (transformers Qwen2_5_VLForConditionalGeneration), a
windowed-attention vision tower whose merged patches replace the image tokens of a Qwen2 language
model with 3-D multimodal RoPE, run as the autoregressive text policy on prompts with images
(stages/models/qwen_vl.py holds what it shares with `qwen3_vl`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.models.qwen_vl import QwenVL, TinyVL, VLModelConfig, mrope_section
from unirl.stages.runtime.registry import families


class Qwen2_5_VLModelConfig(VLModelConfig):
    """A Qwen2.5-VL vision-language model (transformers Qwen2_5_VLForConditionalGeneration)."""

    kind: Literal["qwen2_5_vl"] = Field("qwen2_5_vl", description="Model family.")


@families.register("qwen2_5_vl")
class Qwen2_5_VL(QwenVL):
    name = "qwen2_5_vl"
    config = Qwen2_5_VLModelConfig
    modules = ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
               "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "peft")

    @classmethod
    def model_class(cls) -> Any:
        from transformers import Qwen2_5_VLForConditionalGeneration  # start-up time: transformers loads on first use, not when a recipe is read

        return Qwen2_5_VLForConditionalGeneration

    @classmethod
    def tiny_config(cls, tiny: TinyVL, vocab_size: int, ids: dict[str, int]) -> Any:
        """Windows of 4 x 4 image tokens in every vision block but the last, which attends to the
        whole image (the real model's pattern at 1/8 of its depth)."""
        from transformers import Qwen2_5_VLConfig  # start-up time: transformers loads on first use, not when a recipe is read

        t, v = tiny.text, tiny.vision
        head_dim = t.hidden_size // t.num_attention_heads
        return Qwen2_5_VLConfig(
            text_config=dict(vocab_size=vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                             num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                             num_key_value_heads=t.num_key_value_heads, max_position_embeddings=t.max_position_embeddings,
                             rope_scaling={"type": "mrope", "mrope_section": mrope_section(head_dim, (16, 24, 24))},
                             bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
            vision_config=dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                               num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                               temporal_patch_size=2, out_hidden_size=t.hidden_size,
                               window_size=4 * v.patch_size * v.spatial_merge_size, fullatt_block_indexes=[v.depth - 1]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )

"""The `qwen3_vl` family: Qwen3-VL (transformers Qwen3VLForConditionalGeneration), a vision tower
with learned position embeddings whose early blocks also feed the first decoder layers
(DeepStack), and a Qwen3 language model with interleaved 3-D multimodal RoPE, run as the
autoregressive text policy on prompts with images (stages/models/qwen_vl.py holds what it shares
with `qwen2_5_vl`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.models.qwen_vl import QwenVL, TinyVL, VLModelConfig, mrope_section
from unirl.stages.runtime.registry import families


class Qwen3VLModelConfig(VLModelConfig):
    """A Qwen3-VL vision-language model (transformers Qwen3VLForConditionalGeneration)."""

    kind: Literal["qwen3_vl"] = Field("qwen3_vl", description="Model family.")


@families.register("qwen3_vl")
class Qwen3VL(QwenVL):
    name = "qwen3_vl"
    config = Qwen3VLModelConfig
    modules = ("transformers.models.qwen3_vl.modeling_qwen3_vl",
               "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "peft")

    @classmethod
    def model_class(cls) -> Any:
        from transformers import Qwen3VLForConditionalGeneration  # start-up time: transformers loads on first use, not when a recipe is read

        return Qwen3VLForConditionalGeneration

    @classmethod
    def tiny_config(cls, tiny: TinyVL, vocab_size: int, ids: dict[str, int]) -> Any:
        """An 8 x 8 grid of learned vision position embeddings (resampled to each image's grid), and
        DeepStack features from the first vision block into the first decoder layer."""
        from transformers import Qwen3VLConfig  # start-up time: transformers loads on first use, not when a recipe is read

        t, v = tiny.text, tiny.vision
        head_dim = t.hidden_size // t.num_attention_heads
        return Qwen3VLConfig(
            text_config=dict(vocab_size=vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                             num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                             num_key_value_heads=t.num_key_value_heads, head_dim=head_dim,
                             max_position_embeddings=t.max_position_embeddings,
                             rope_scaling={"rope_type": "default", "mrope_section": mrope_section(head_dim, (24, 20, 20)),
                                           "mrope_interleaved": True},
                             bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
            vision_config=dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                               num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                               temporal_patch_size=2, out_hidden_size=t.hidden_size, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )

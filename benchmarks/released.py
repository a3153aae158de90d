"""Config-only folders of released models: each file a checkpoint of the release ships except its
weights, at the published geometry, so `unirl validate` and `unirl validate --memory` can read a
real workload's recipe without downloading anything (docs/scaling.md), and the benchmarks can build
random-init models of that size.

    python benchmarks/released.py DIR            # DIR/Qwen3-0.6B, DIR/Qwen3-4B-Base, DIR/stable-diffusion-3.5-medium

The numbers are those of the releases' config files (Qwen3 technical report, Table 1; the
stable-diffusion-3.5-medium diffusers folder: an MMDiT of 24 blocks of 24 heads of 64, dual attention
in blocks 0-12, CLIP-L, OpenCLIP bigG and T5-XXL encoders, a 16-channel VAE).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

QWEN3_COMMON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128,
                "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
                "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
QWEN3 = {
    "Qwen3-0.6B": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "intermediate_size": 3072, "tie_word_embeddings": True},
    "Qwen3-4B-Base": {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "intermediate_size": 9728, "tie_word_embeddings": True, "max_position_embeddings": 32768},
}

SD35_MEDIUM_TRANSFORMER = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16,
    "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}
SD35_VAE = {
    "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu",
    "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False,
    "use_post_quant_conv": False, "force_upcast": True, "mid_block_add_attention": True,
}
CLIP = {"model_type": "clip_text_model", "architectures": ["CLIPTextModelWithProjection"], "vocab_size": 49408,
        "max_position_embeddings": 77, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
SD35_TEXT = {
    "text_encoder": {**CLIP, "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
                     "projection_dim": 768, "hidden_act": "quick_gelu"},
    "text_encoder_2": {**CLIP, "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
                       "num_hidden_layers": 32, "projection_dim": 1280, "hidden_act": "gelu"},
    "text_encoder_3": {"model_type": "t5", "architectures": ["T5EncoderModel"], "vocab_size": 32128, "d_model": 4096,
                       "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "feed_forward_proj": "gated-gelu",
                       "is_encoder_decoder": True, "relative_attention_num_buckets": 32},
}
SD35_TOKENIZERS = {"tokenizer": 77, "tokenizer_2": 77, "tokenizer_3": 512}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def qwen3(root: Path, name: str, **overrides: Any) -> Path:
    """`root/name` with the release's config.json (`overrides` on top: fewer layers for a benchmark)."""
    folder = Path(root) / name
    write_json(folder / "config.json", {**QWEN3_COMMON, **QWEN3[name], **overrides})
    return folder


def sd35_medium(root: Path, name: str = "stable-diffusion-3.5-medium", **transformer: Any) -> Path:
    """`root/name` as the release's diffusers folder without weights: model_index.json, each
    component's config and the tokenizers' lengths (`transformer` overrides its config)."""
    folder = Path(root) / name
    clip, t5 = ["transformers", "CLIPTextModelWithProjection"], ["transformers", "T5EncoderModel"]
    write_json(folder / "model_index.json", {
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": clip, "text_encoder_2": clip, "text_encoder_3": t5, "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"], "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "image_encoder": [None, None], "feature_extractor": [None, None]})
    write_json(folder / "transformer" / "config.json", {**SD35_MEDIUM_TRANSFORMER, **transformer})
    write_json(folder / "vae" / "config.json", SD35_VAE)
    write_json(folder / "scheduler" / "scheduler_config.json",
               {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})
    for encoder, config in SD35_TEXT.items():
        write_json(folder / encoder / "config.json", config)
    for tokenizer, length in SD35_TOKENIZERS.items():
        write_json(folder / tokenizer / "tokenizer_config.json", {"model_max_length": length})
    return folder


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/released.py DIR")
    root = Path(sys.argv[1])
    for folder in (qwen3(root, "Qwen3-0.6B"), qwen3(root, "Qwen3-4B-Base"), sd35_medium(root)):
        print(folder)


if __name__ == "__main__":
    main()

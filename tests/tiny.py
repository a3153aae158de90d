"""Tiny recipes of every registered family, shared by the tests: small enough for one iteration in
a second or two on a CPU, with a reward that varies on a random model, so an update has a signal."""
from __future__ import annotations

from typing import Any


def merged(*parts: dict) -> dict:
    """Nested dicts merged left to right (later values win; dicts merge)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


TRANSFUSION = {"image_size": 16, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
               "vae_channels": [8, 8], "max_text_len": 32, "text_length": 8, "vocabulary": "words"}
TINY: dict[str, Any] = {
    "qwen3": {"model": {"kind": "qwen3", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}},
              "data": {"name": "arithmetic"}, "reward": {"scorers": [{"name": "integer_format"}]},
              "rollout": {"prompts_per_iteration": 3, "group_size": 4, "max_new_tokens": 3},
              "train": {"micro_batch_size": 4}},
    # Vision-language: toy VQA questions with their images; the answer's length varies on a random
    # model, so groups have a signal. Qwen2.5-VL trains its vision tower (FSDP2 units of their own
    # at world size 2), Qwen3-VL keeps it frozen (the default).
    **{kind: {"model": {"kind": kind, "train_vision": kind == "qwen2_5_vl",
                        "tiny": {"text": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}}},
              "data": {"name": "toy_vqa", "heldout_size": 4},
              "reward": {"scorers": [{"name": "text_length", "params": {"max_length": 3}}]},
              "rollout": {"prompts_per_iteration": 3, "group_size": 4, "max_new_tokens": 3},
              "train": {"micro_batch_size": 4}} for kind in ("qwen2_5_vl", "qwen3_vl")},
    "sd3": {"model": {"kind": "sd3", "tiny": {"image_size": 16}}, "data": {"name": "geneval"},
            "reward": {"scorers": [{"name": "brightness"}]},
            "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
            "train": {"micro_batch_size": 4}},
    "flux2_klein": {"model": {"kind": "flux2_klein", "tiny": {"image_size": 16}}, "data": {"name": "geneval"},
                    "reward": {"scorers": [{"name": "brightness"}]},
                    "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
                    "train": {"micro_batch_size": 4}},
    "qwen_image": {"model": {"kind": "qwen_image", "tiny": {"image_size": 16}}, "data": {"name": "geneval"},
                   "reward": {"scorers": [{"name": "colorfulness"}]},
                   "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
                   "train": {"micro_batch_size": 4}},
    "hunyuan_video": {"model": {"kind": "hunyuan_video", "tiny": {"image_size": 16, "num_frames": 5}}, "data": {"name": "videotoy"},
                      "reward": {"scorers": [{"name": "video", "params": {"scorer": "colorfulness"}}]},
                      "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
                      "train": {"micro_batch_size": 4}},
    "wan": {"model": {"kind": "wan", "tiny": {"image_size": 16, "num_frames": 5}}, "data": {"name": "videotoy"},
            "reward": {"scorers": [{"name": "video", "params": {"scorer": "brightness", "max_frames": 3}}]},
            "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
            "train": {"micro_batch_size": 4}},
    # The unified family: its default policy draws (flow); TEXT_CASES below runs its text policy.
    "transfusion": {"model": {"kind": "transfusion", "tiny": TRANSFUSION}, "data": {"name": "geneval"},
                    "reward": {"scorers": [{"name": "brightness"}]},
                    "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3, "init_same_noise": False}},
                    "train": {"micro_batch_size": 4}},
}
# Variants of a family the matrix runs too (a second architecture behind one `model.kind`).
VARIANTS: dict[str, Any] = {
    "wan2.2": {"model": {"kind": "wan", "tiny": {"experts": 2, "boundary_ratio": 0.7}}},
    "hunyuan_video1.5": {"model": {"kind": "hunyuan_video", "tiny": {"version": "1.5", "vae_channels": [8, 8], "vae_temporal": 2}}},
}
# A family offering several policies on one set of weights runs each: the same model, sampled as text.
TEXT_CASES: dict[str, Any] = {
    "transfusion_text": {"model": {"kind": "transfusion", "tiny": TRANSFUSION}, "data": {"name": "pe_geneval", "kinds": ["single"]},
                         "reward": {"scorers": [{"name": "text_length", "params": {"max_length": 24}}]},
                         "rollout": {"kind": "text", "prompts_per_iteration": 3, "group_size": 4, "max_new_tokens": 3},
                         "train": {"micro_batch_size": 4}},
}
CASES: dict[str, Any] = {**TINY, **{name: merged(TINY[over["model"]["kind"]], over) for name, over in VARIANTS.items()}, **TEXT_CASES}
# What an algorithm needs beyond the family's tiny recipe, and options the matrix exercises on the
# way: KL to the reference (the frozen copy; LoRA's adapter-disabled reference is in the e2e
# tests), classifier-free guidance with a negative prompt.
EXTRA: dict[str, Any] = {"nft": {"train": {"ema": {"decay": 0.5}}, "algorithm": {"timesteps": 2}},
         "mixgrpo": {"rollout": {"sampler": {"sde_steps": {"window_size": 2}}}},
         "gspo": {"algorithm": {"kl_coef": 0.05, "kl_estimator": "k2"}},
         "drpo": {"algorithm": {"kl_coef": 0.05, "kl_estimator": "k1"}},
         "flow_grpo": {"rollout": {"sampler": {"guidance_scale": 2.0, "negative_prompt": "a black square"}}}}

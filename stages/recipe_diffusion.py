"""Recipe sections of the diffusion (flow-matching) track; `stages/recipe.py` puts them into the
Recipe's unions. Models: `model.kind: sd3`; data: `data.name: geneval`; losses: `flow_grpo`,
`flow_dppo`, `nft`; sampling: `rollout.sampler`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.config_base import Section


class TinySD3(Section):
    """Architecture of the seeded random SD3 used when `model.path` is empty."""

    image_size: int = Field(32, ge=8, description="Side of generated images in pixels.")
    seed: int = Field(0, description="Seed of the random initialisation.")


class LoraConfig(Section):
    """LoRA adapters through peft; the reference policy is the adapter disabled."""

    rank: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling alpha (effective scale alpha/r).")
    target_modules: list[str] = Field(default_factory=list, description="Module name suffixes; empty: the model family's default.")


class SD3ModelConfig(Section):
    """Stable Diffusion 3 architecture (diffusers SD3Transformer2DModel + AutoencoderKL + text encoders)."""

    kind: Literal["sd3"] = "sd3"
    path: str | None = Field(None, description="Local diffusers-layout folder; empty: build the tiny seeded model.")
    tiny: TinySD3 = Field(default_factory=TinySD3, description="Tiny architecture, used only without `path`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all transformer weights.")


class GenEvalData(Section):
    """Procedural toy-GenEval prompts (objects, colours, counts, positions)."""

    name: Literal["geneval"] = "geneval"
    seed: int = Field(1234, description="Seed of the prompt stream.")
    heldout_size: int = Field(32, ge=0, description="Held-out prompts used for evaluation.")


class DiffusionSampler(Section):
    """How images are sampled (diffusion models only)."""

    num_steps: int = Field(10, ge=1, description="Denoising steps T.")
    shift: float = Field(3.0, gt=0, description="Sigma shift (DESIGN.md `shifted_sigmas`).")
    guidance_scale: float = Field(1.0, ge=1, description="Classifier-free guidance; 1 is guidance-free.")
    negative_prompt: str = Field("", description="Negative prompt for CFG.")
    eta: float = Field(0.7, ge=0, description="SDE noise level.")
    sde_kind: Literal["flow", "dance", "cps", "ode"] = Field("flow", description="SDE step kernel.")
    init_same_noise: bool = Field(True, description="One initial noise per group (else per sample).")


class FlowGRPOConfig(Section):
    """Flow-GRPO (Liu et al. 2025)."""

    name: Literal["flow_grpo"] = "flow_grpo"
    clip_range: float = Field(1e-4, gt=0, description="Ratio clip epsilon.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of flow_kl to the reference (adapter disabled).")


class FlowDPPOConfig(Section):
    """Flow-DPPO: drop updates whose per-step KL passes a threshold in the ratio's direction."""

    name: Literal["flow_dppo"] = "flow_dppo"
    threshold: float = Field(1e-5, gt=0, description="Per-step KL threshold.")


class NFTConfig(Section):
    """DiffusionNFT: negative-aware fine-tuning with an EMA old policy."""

    name: Literal["nft"] = "nft"
    beta: float = Field(1.0, gt=0, description="Guidance strength beta.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip c.")
    adaptive_weight: bool = Field(True, description="Normalize by the detached x0 error.")

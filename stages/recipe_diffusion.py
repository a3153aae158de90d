"""Recipe sections of the diffusion (flow-matching) track; `stages/recipe.py` puts them into the
Recipe's unions. Models: `model.kind: sd3`; data: `data.name: geneval`; losses: `flow_grpo`,
`flow_dppo`, `nft`; sampling: `rollout.sampler`.

Checks that need two sections at once (an `nft` recipe needs `train.ema`; the sampled image size
must suit the VAE) are in `check_diffusion_recipe`, which the Recipe's validator calls, so they
fail at `unirl validate`, before any model is loaded. Nothing here imports torch.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from stages.config_base import Section


class TinySD3(Section):
    """Architecture of the seeded random SD3 used when `model.path` is empty."""

    image_size: int = Field(32, ge=8, description="Side of generated images in pixels.")
    seed: int = Field(0, description="Seed of the random initialisation.")
    num_layers: int = Field(2, ge=1, description="MMDiT blocks of the transformer.")
    num_heads: int = Field(4, ge=1, description="Attention heads per block.")
    head_dim: int = Field(16, ge=4, description="Width of one attention head.")
    patch_size: int = Field(4, ge=1, description="Transformer patch side, in latent pixels.")
    vae_channels: list[int] = Field(
        [32], min_length=1,
        description="VAE block widths (multiples of 8); the VAE downsamples by 2**(len-1). The default one block "
        "(no downsampling) reconstructs toy-GenEval scenes exactly after a few hundred warm-up steps.",
    )
    latent_channels: int = Field(4, ge=1, description="Channels of the VAE latent.")
    vae_mid_attention: bool = Field(False, description="Self-attention in the VAE's mid block (SD3's VAE has it; slow at full resolution).")
    with_t5: bool = Field(True, description="Build the T5 text encoder too (else SD3's zero rows stand in).")

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)

    @model_validator(mode="after")
    def _check_sizes(self) -> "TinySD3":
        bad = [c for c in self.vae_channels if c % 8]
        if bad:
            raise ValueError(f"model.tiny.vae_channels: {bad} are not multiples of 8 (the VAE's GroupNorm has 8 groups)")
        check_image_side("model.tiny.image_size", self.image_size, self.vae_factor, self.patch_size)
        return self

    def build_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `stages.models.sd3.build_tiny_sd3` for this architecture."""
        return {
            "seed": self.seed, "image_size": self.image_size, "with_t5": self.with_t5,
            "num_layers": self.num_layers, "num_heads": self.num_heads, "head_dim": self.head_dim,
            "patch_size": self.patch_size, "vae_channels": tuple(self.vae_channels),
            "latent_channels": self.latent_channels, "vae_mid_attention": self.vae_mid_attention,
        }


def check_image_side(field: str, size: int, vae_factor: int, patch: int) -> None:
    """ValueError naming `field` unless the VAE (downsampling by `vae_factor`) and the transformer
    (patch `patch`) can take images of side `size`."""
    step = vae_factor * patch
    if size % step:
        ok = ", ".join(str(step * k) for k in range(max(1, size // step - 1), size // step + 3))
        raise ValueError(
            f"{field}: image size {size} cannot be taken by the VAE (downsamples by {vae_factor}) and the "
            f"transformer (patch {patch}): use a multiple of {step} (e.g. {ok})"
        )


class LoraConfig(Section):
    """LoRA adapters through peft; the reference policy is the adapter disabled."""

    rank: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling alpha (effective scale alpha/r).")
    target_modules: list[str] = Field(default_factory=list, description="Module name suffixes; empty: the model family's default.")


class VAEWarmup(Section):
    """Reconstruction training of the VAE before flow-matching SFT (a tiny model's VAE is random)."""

    steps: int | None = Field(
        None, ge=0, description="Optimizer steps; empty: 400 for the tiny model (no `model.path`), 0 for a checkpoint."
    )
    lr: float = Field(2e-3, gt=0, description="Adam learning rate (cosine decay to 0).")
    batch_size: int = Field(32, ge=1, description="Images per step.")

    def resolved_steps(self, has_path: bool) -> int:
        return (0 if has_path else 400) if self.steps is None else self.steps


class FlowMatchingSFT(Section):
    """How SFT trains the transformer (the `sft` section sets steps, batch size, lr and seed)."""

    ema: float = Field(
        0.999, ge=0, lt=1,
        description="Decay of an EMA of the weights during SFT; the EMA is what SFT publishes (0: the raw weights).",
    )
    schedule: Literal["constant", "cosine"] = Field("cosine", description="lr over `sft.steps`, after the warm-up.")
    warmup_steps: int = Field(100, ge=0, description="Linear lr warm-up steps.")


class SD3ModelConfig(Section):
    """Stable Diffusion 3 architecture (diffusers SD3Transformer2DModel + AutoencoderKL + text encoders)."""

    kind: Literal["sd3"] = "sd3"
    path: str | None = Field(None, description="Local diffusers-layout folder; empty: build the tiny seeded model.")
    tiny: TinySD3 = Field(default_factory=TinySD3, description="Tiny architecture, used only without `path`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all transformer weights.")
    vae_warmup: VAEWarmup = Field(default_factory=VAEWarmup, description="VAE reconstruction training at the start of SFT.")
    flow_matching: FlowMatchingSFT = Field(default_factory=FlowMatchingSFT, description="Transformer training in SFT.")


class GenEvalData(Section):
    """Procedural toy-GenEval prompts (objects, colours, counts, positions)."""

    name: Literal["geneval"] = "geneval"
    seed: int = Field(1234, description="Seed of the prompt stream.")
    heldout_size: int = Field(32, ge=0, description="Held-out prompts used for evaluation.")
    prompts: list[str] = Field(
        default_factory=list, description="Train on these prompts (cycled) instead of the generated stream; each must parse."
    )

    @model_validator(mode="after")
    def _check_prompts(self) -> "GenEvalData":
        from stages.geneval.dataset import parse_prompt  # numpy + PIL only

        for i, text in enumerate(self.prompts):
            try:
                parse_prompt(text)
            except ValueError as exc:
                raise ValueError(f"data.prompts.{i}: {exc}") from None
        return self


class SDESteps(Section):
    """Which denoising steps are SDE steps (sampled with noise, stored and trained on); the others
    are ODE (Euler) steps. See `stages.sde.select_sde_steps`."""

    mode: Literal["all", "window", "mixgrpo"] = Field(
        "all",
        description="all: every step; window: `num_sde_steps` of a `window_size` block drawn per iteration "
        "(Flow-GRPO-Fast); mixgrpo: a `window_size` block sliding by `stride` every `shift_every` iterations.",
    )
    window: tuple[float, float] = Field((0.0, 1.0), description="[lo, hi) fractions of the schedule the steps come from.")
    window_size: int | None = Field(None, ge=1, description="Steps in the block; empty: the whole `window`.")
    num_sde_steps: int | None = Field(None, ge=1, description="mode window: steps drawn from the block; empty: all of it.")
    stride: int = Field(1, ge=1, description="mode mixgrpo: steps the block moves at a time.")
    shift_every: int = Field(1, ge=1, description="mode mixgrpo: iterations between moves.")
    wrap: bool = Field(False, description="mode mixgrpo: restart from the first step after the last position.")


def fraction_range(num_steps: int, window: tuple[float, float]) -> tuple[int, int]:
    """`stages.sde._fraction_range` without torch: steps i with lo <= i/T < hi as [first, end)."""
    lo, hi = window
    return math.ceil(lo * num_steps - 1e-9), math.ceil(hi * num_steps - 1e-9)


class DiffusionSampler(Section):
    """How images are sampled (diffusion models only)."""

    num_steps: int = Field(10, ge=1, description="Denoising steps T.")
    shift: float = Field(3.0, gt=0, description="Sigma shift (DESIGN.md `shifted_sigmas`).")
    dynamic_shift: bool = Field(False, description="Shift from the number of latent tokens (FLUX / SD3.5) instead of `shift`.")
    guidance_scale: float = Field(1.0, ge=1, description="Classifier-free guidance; 1 is guidance-free.")
    negative_prompt: str = Field("", description="Negative prompt for CFG.")
    eta: float = Field(0.7, ge=0, description="SDE noise level.")
    sde_kind: Literal["flow", "dance", "cps", "ode"] = Field("flow", description="SDE step kernel.")
    init_same_noise: bool = Field(True, description="One initial noise per group (else per sample).")
    image_size: int | None = Field(None, ge=8, description="Side of sampled images; empty: the model's default.")
    sde_steps: SDESteps = Field(default_factory=SDESteps, description="Which steps are SDE steps.")
    grid_every: int = Field(1, ge=0, description="Log an image grid of the rollouts to MLflow every N iterations (0: never).")

    @model_validator(mode="after")
    def _check_window(self) -> "DiffusionSampler":
        sel, t = self.sde_steps, self.num_steps
        lo, hi = sel.window
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"rollout.sampler.sde_steps.window: need 0 <= lo < hi <= 1, got [{lo}, {hi}]")
        if sel.mode == "all":
            return self
        first, end = fraction_range(t, sel.window)
        span = end - first
        if span < 1:
            raise ValueError(
                f"rollout.sampler.sde_steps.window: [{lo}, {hi}] holds no step of num_steps={t}; widen it or raise num_steps"
            )
        size = span if sel.window_size is None else sel.window_size
        if size > span:
            raise ValueError(
                f"rollout.sampler.sde_steps.window_size: {size} is larger than the {span} steps available "
                f"(steps {first}..{end - 1} of num_steps={t} in window [{lo}, {hi}]); lower window_size, "
                "widen window or raise rollout.sampler.num_steps"
            )
        if sel.mode == "window" and sel.num_sde_steps is not None and sel.num_sde_steps > size:
            raise ValueError(
                f"rollout.sampler.sde_steps.num_sde_steps: {sel.num_sde_steps} is more than the window's {size} steps"
            )
        return self


class FlowGRPOConfig(Section):
    """Flow-GRPO (Liu et al. 2025). DanceGRPO and MixGRPO are this loss with `rollout.sampler`
    settings (`sde_kind: dance`; `sde_steps.mode: mixgrpo`)."""

    name: Literal["flow_grpo"] = "flow_grpo"
    clip_range: float = Field(1e-4, gt=0, description="Ratio clip epsilon.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of flow_kl to the reference (adapter disabled, or the initial weights).")


class FlowDPPOConfig(Section):
    """Flow-DPPO: drop updates whose per-step KL passes a threshold in the ratio's direction."""

    name: Literal["flow_dppo"] = "flow_dppo"
    threshold: float = Field(1e-5, gt=0, description="Per-step KL threshold.")


class NFTConfig(Section):
    """DiffusionNFT: negative-aware fine-tuning with an EMA old policy (`train.ema`), which samples
    the rollouts and gives v_old."""

    name: Literal["nft"] = "nft"
    beta: float = Field(1.0, gt=0, description="Guidance strength beta.")
    adv_clip: float = Field(5.0, gt=0, description="Advantage clip c.")
    adaptive_weight: bool = Field(True, description="Normalize by the detached x0 error.")
    timesteps: int = Field(4, ge=1, description="Noise levels t drawn per sample and update (gradient accumulated).")
    ema_ramp: float = Field(
        0.0, ge=0,
        description="Decay schedule of the old policy: decay at optimizer step k is min(train.ema.decay, "
        "ramp * (k - ema_flat_steps)) and 0 before ema_flat_steps; 0: train.ema.decay from the start.",
    )
    ema_flat_steps: int = Field(0, ge=0, description="Steps with decay 0 (old policy = current policy) before the ramp.")

    def ema_decay(self, step: int, max_decay: float) -> float:
        """The old policy's EMA decay at optimizer step `step` (0-based)."""
        if step < self.ema_flat_steps:
            return 0.0
        if self.ema_ramp == 0:
            return max_decay
        return min(max_decay, self.ema_ramp * (step - self.ema_flat_steps))


def check_diffusion_recipe(recipe: Any) -> None:
    """Cross-section checks of an `sd3` recipe; ValueError('field.path: what to do')."""
    if recipe.model.kind != "sd3":
        return
    if recipe.algorithm.name == "nft" and getattr(recipe.train, "ema", None) is None:
        raise ValueError(
            "train.ema: algorithm `nft` samples with and regresses against an EMA old policy; set "
            "`train: {ema: {decay: 0.9}}` (see recipes/diffusion/nft.yaml)"
        )
    sampler = recipe.rollout.sampler
    if sampler.init_same_noise and (sampler.eta == 0 or sampler.sde_kind == "ode") and recipe.rollout.group_size > 1:
        raise ValueError(
            "rollout.sampler.init_same_noise: with deterministic sampling (eta 0 or sde_kind ode) one initial "
            "noise per group makes every image of a group the same, so no group carries a signal; set "
            "`init_same_noise: false`"
        )
    size = sampler.image_size
    if size is not None and not recipe.model.path:
        tiny = recipe.model.tiny
        check_image_side("rollout.sampler.image_size", size, tiny.vae_factor, tiny.patch_size)
    if recipe.data.name == "geneval":
        from stages.geneval.dataset import MIN_IMAGE_SIZE

        side = size or (None if recipe.model.path else recipe.model.tiny.image_size)
        if side is not None and side < MIN_IMAGE_SIZE:
            raise ValueError(f"rollout.sampler.image_size: toy GenEval needs images of at least {MIN_IMAGE_SIZE} px, got {side}")

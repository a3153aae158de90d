"""What the flow policy (stages/policies/flow.py) asks of a flow family, and what every flow family
shares: one base class, `FlowFamily`, so a family file says only what is its own (its components,
its text conditioning, how its transformer is called) and nothing of the rest is copied per family.

Conventions (rectified flow, as every family here is trained):
  x_sigma = (1 - sigma) * x0 + sigma * noise, sigma in [0, 1] (1 = pure noise); the model predicts
  v = dx/dsigma = noise - x0, so an Euler step is x + v * (sigma_next - sigma). Latents are what the
  policy samples: (C, h, w) for images, (C, F, h, w) for video, in the family's own normalized VAE
  space (stages/models/flow_vae.py); packing into tokens, position ids and RoPE inputs happen
  inside `forward`, which the sampler and the losses never see.

A family supplies:
  geometry(bundle) / recipe_geometry(cfg)   pixels -> latents -> tokens (stages/models/flow_geometry.py)
  codec(bundle)                            the VAE's normalization (stages/models/flow_vae.py)
  encode_prompt(bundle, text)              one prompt -> a tuple of conditioning tensors, fixed shapes
  forward(bundle, module, x, sigma, cond, guidance) -> v   one transformer call, its timestep as the
                                           transformer takes it (`timestep_scale`: sigma * 1000 or sigma)
  uses_cfg(bundle)                         False for guidance-distilled models: the sampler's
                                           guidance_scale goes into the transformer's guidance input
  load / materialize / build_tiny          the folder and the bundle
and gets from here: the velocity with classifier-free guidance (one batched forward of 2B), decode
and encode, the size and frame checks (validate time and bundle time), SFT's VAE preparation, LoRA
and its adapter-disabled reference, FSDP2 units and export to a diffusers folder.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from unirl.stages.models.family import Family, get_family
from unirl.stages.models.flow_folder import check_pipeline, component_parameters, listed, read_index, write_folder
from unirl.stages.models.flow_geometry import FlowGeometry
from unirl.stages.models.flow_lora import add_lora, merge_lora, reference_policy
from unirl.stages.runtime.config_base import LoraConfig, Section

if TYPE_CHECKING:
    import torch

# ---------------------------------------------------------------------------- shared recipe sections


class VAEWarmup(Section):
    """Reconstruction training of the VAE before flow-matching SFT (a tiny model's VAE is random)."""

    steps: int | None = Field(
        None, ge=0, description="Optimizer steps; empty: 400 for the tiny model (no `model.path`), 0 for a checkpoint."
    )
    lr: float = Field(2e-3, gt=0, description="Adam learning rate (cosine decay to 0).")
    batch_size: int = Field(32, ge=1, description="Images (or clips) per step.")

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
    sigma_shift: float = Field(
        1.0, gt=0,
        description="Shift of the logit-normal training sigmas, s*sigma / (1 + (s-1)*sigma), as the sampler's `shift` "
                    "shifts its steps (diffusers' SD3 trainer draws from its shifted scheduler): > 1 trains more at high "
                    "noise, where a shifted sampler spends its first steps and a clip's layout and motion are decided.",
    )


class TinyFlow(Section):
    """What every tiny seeded flow model has (used only when `model.path` is empty)."""

    image_size: int = Field(16, ge=8, description="Side of generated images (or video frames) in pixels.")
    seed: int = Field(0, ge=0, description="Seed of the random initialisation.")
    num_layers: int = Field(1, ge=1, description="Transformer blocks.")
    num_heads: int = Field(2, ge=1, description="Attention heads per block.")
    head_dim: int = Field(16, ge=4, description="Width of one attention head (a multiple of 4).")
    patch_size: int = Field(2, ge=1, description="Transformer patch side, in latent pixels.")
    latent_channels: int = Field(4, ge=1, description="Channels of the VAE latent.")
    vae_channels: list[int] = Field(
        [8, 8], min_length=1, description="VAE block widths; the VAE downsamples space by 2**(len-1).")
    text_hidden: int = Field(16, ge=8, description="Width of the tiny text encoder (a multiple of 8).")
    text_layers: int = Field(1, ge=1, description="Layers of the tiny text encoder.")
    text_length: int = Field(16, ge=2, description="Text tokens per prompt (padded).")

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)


class TinyVideo(TinyFlow):
    """A tiny seeded video model: a frame count too."""

    num_frames: int = Field(5, ge=1, description="Frames of generated clips.")


class FlowModelBase(Section):
    """The `model:` fields every flow family shares (a family adds `kind` and `tiny`)."""

    path: str | None = Field(None, description="Local diffusers-layout folder; empty: build the tiny seeded model.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all transformer weights.")
    vae_warmup: VAEWarmup = Field(default_factory=VAEWarmup, description="VAE reconstruction training at the start of SFT.")
    flow_matching: FlowMatchingSFT = Field(default_factory=FlowMatchingSFT, description="Transformer training in SFT.")


# ---------------------------------------------------------------------------- the bundle


@dataclass
class FlowBundle:
    """A loaded flow model. `transformer`: what trains (one diffusers transformer, or a container of
    experts); `text`: text encoders and tokenizers by their folder names; `settings`: what the family
    read from the folder (text lengths, layers, guidance); `geometry`: pixels -> latents -> tokens."""

    transformer: Any
    vae: Any
    text: dict[str, Any]
    directory: Path
    index: dict[str, Any]
    geometry: FlowGeometry
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def module(self) -> Any:
        return self.transformer

    @module.setter
    def module(self, value: Any) -> None:
        self.transformer = value

    @property
    def device(self) -> Any:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> Any:
        return next(self.transformer.parameters()).dtype


def freeze(*models: Any, device: Any) -> None:
    """Frozen parts (text encoders, VAE): no gradients, eval mode, on `device`."""
    for model in models:
        if model is not None and hasattr(model, "requires_grad_"):
            model.requires_grad_(False).eval().to(device)


@dataclass
class FlowParts:
    """What every diffusers folder gives a family's `load` (`FlowFamily.load_parts`): the checked
    index, the VAE and text parts frozen on the device, the transformers (experts) in eval mode."""

    root: Path
    index: dict[str, Any]
    vae: Any
    text: dict[str, Any]
    transformers: list[Any]


@dataclass(frozen=True)
class MemoryProbe:
    """What `unirl validate --memory` (stages/run/memory.py) needs of a flow model, read from its
    configs without loading weights: each component's parameters (`trained`: the transformer,
    with `buffers` elements of buffers such as a position table, whole on every rank; `frozen`: text
    encoders and VAE with their buffers, whole on every rank), the transformer's blocks (the largest's
    parameters) and its parameters outside them, LoRA's parameters for the recipe's adapters, the conditioning tokens
    a prompt adds to the transformer's sequence, whether guidance doubles the batch, and `make`:
    (blocks, dtype) -> (a transformer of the real width with that many blocks, randomly
    initialised, and run(module, latents, sigma) -> velocity, its forward on a batch of one
    prompt's zero conditioning)."""

    trained: int
    buffers: int
    frozen: dict[str, int]
    blocks: int
    block_params: int
    outside: int
    lora: int
    text_tokens: int
    cfg_doubles: bool
    make: Any


def lora_parameters(module: Any, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Parameters LoRA of `rank` adds on the linears of `module` whose name is or ends with a target
    (peft's matching): rank x (in + out) each."""
    import torch  # start-up time: loaded on first use

    return sum(rank * (m.in_features + m.out_features) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


# ---------------------------------------------------------------------------- the base class


class FlowFamily(Family):
    policy = "flow"
    produces = ("image",)
    # model_index.json `_class_name`s this family loads (a folder of another is refused at validate).
    pipelines: ClassVar[tuple[str, ...]] = ()
    # The transformer's timestep input is sigma * timestep_scale.
    timestep_scale: ClassVar[float] = 1000.0
    # Attributes of a transformer holding the blocks FSDP2 shards one by one.
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def load_parts(cls, directory: Path, cfg: Any, device: Any, *, text: tuple[str, ...] = ("text_encoder", "tokenizer"),
                   experts: tuple[str, ...] = ("transformer",)) -> FlowParts:
        """The folder's parts, loaded as its model_index.json names them, models in `cfg.dtype`:
        the VAE, the `text` parts (encoders and tokenizers) and the transformers `experts` names
        (the first always, the others where the index lists them). The folder must be one this
        family loads (check_pipeline)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models.flow_folder import check_pipeline, listed, load_component

        root = Path(directory)
        index = check_pipeline(root, cls.name, cls.pipelines)
        dtype = getattr(torch, cfg.dtype)
        vae = load_component(root, index, "vae", dtype)
        parts = {name: load_component(root, index, name, None if name.startswith("tokenizer") else dtype) for name in text}
        transformers = [load_component(root, index, name, dtype) for k, name in enumerate(experts) if k == 0 or listed(index, name)]
        freeze(vae, *(parts[name] for name in text if not name.startswith("tokenizer")), device=device)
        for transformer in transformers:
            transformer.eval().to(device)
        return FlowParts(root, index, vae, parts, transformers)

    # -- geometry -------------------------------------------------------------------------------
    @classmethod
    def geometry(cls, bundle: Any) -> FlowGeometry:
        return bundle.geometry

    @classmethod
    def recipe_geometry(cls, cfg: Any) -> FlowGeometry | None:
        """The geometry a recipe's model has, from its tiny section or its folder's configs (no
        weights loaded); None when it cannot be known before loading."""
        return None

    @classmethod
    def default_image_size(cls, bundle: Any) -> int:
        return int(bundle.settings["image_size"])

    @classmethod
    def default_num_frames(cls, bundle: Any) -> int | None:
        return bundle.settings.get("num_frames") if cls.geometry(bundle).video else None

    @classmethod
    def check_image_size(cls, bundle: Any, height: int, width: int | None = None) -> None:
        geo = cls.geometry(bundle)
        for side in (height, height if width is None else width):
            geo.check_side(int(side))

    @classmethod
    def latent_shape(cls, bundle: Any, image_size: int, num_frames: int | None = None) -> tuple[int, ...]:
        return cls.geometry(bundle).latent_shape(image_size, num_frames)

    @classmethod
    def latent_tokens(cls, bundle: Any, shape: tuple[int, ...]) -> int:
        return cls.geometry(bundle).tokens(shape)

    @classmethod
    def dynamic_mu(cls, bundle: Any, tokens: int, num_steps: int) -> float:
        """mu of the resolution-dependent shift (`rollout.sampler.dynamic_shift`)."""
        from unirl.stages.kernels.schedules import dynamic_shift  # start-up time: it loads torch

        return dynamic_shift(tokens)

    @classmethod
    def image_size(cls, cfg: Any) -> int | None:
        """Native image side when it is known from the recipe alone (the tiny model's), else None."""
        return None if cfg.path else cfg.tiny.image_size

    @classmethod
    def native_image_size(cls, cfg: Any) -> int:
        return cls.native_media(cfg)[0]

    @classmethod
    def native_media(cls, cfg: Any) -> tuple[int, int | None]:
        """(image side, frames or None) a model of `cfg` is made for, without loading weights."""
        if cfg.path:
            from unirl.stages.models.flow_folder import folder_defaults  # start-up time: loaded on first use

            found = folder_defaults(Path(cfg.path), cls.pipeline_defaults)
            return int(found["image_size"]), found.get("num_frames")
        return cfg.tiny.image_size, getattr(cfg.tiny, "num_frames", None)

    # The image side, frames and text tokens of a checkpoint without a defaults file (its pipeline's).
    pipeline_defaults: ClassVar[dict[str, Any]] = {"image_size": 1024, "num_frames": None, "text_length": 512}

    @classmethod
    def tiny_defaults(cls, tiny: Any) -> dict[str, Any]:
        """What a tiny folder records of itself (stages/models/flow_folder.py DEFAULTS_FILE)."""
        return {"image_size": tiny.image_size, "num_frames": getattr(tiny, "num_frames", None), "text_length": tiny.text_length}

    # -- conditioning and the velocity --------------------------------------------------------
    @classmethod
    def uses_cfg(cls, bundle: Any) -> bool:
        """Whether guidance_scale > 1 means classifier-free guidance (False: the model is
        guidance-distilled and takes the scale as an input)."""
        return True

    @classmethod
    def encode_prompt(cls, bundle: Any, text: str) -> tuple[torch.Tensor, ...]:
        """The conditioning of one prompt, each tensor without its batch dimension, of the same
        shape for every prompt (padded to a fixed length, with masks where the model takes them)."""
        raise NotImplementedError

    @classmethod
    def forward(cls, bundle: Any, module: Any, x: torch.Tensor, sigma: torch.Tensor, cond: tuple[torch.Tensor, ...],
                guidance: float | None) -> torch.Tensor:
        """One transformer call: v (B, *latent) float32 at latents x (B, *latent), sigma (B,), batched
        `cond`; `guidance`: the guidance input of a guidance-distilled model (None otherwise)."""
        raise NotImplementedError

    @classmethod
    def combine_cfg(cls, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance: v = v_uncond + g * (v_cond - v_uncond)."""
        return uncond + scale * (cond - uncond)

    @classmethod
    def velocity(cls, bundle: Any, module: Any, x: torch.Tensor, sigma: Any, cond: tuple[torch.Tensor, ...],
                 guidance_scale: float, neg: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
        """v (B, *latent) at latents x and noise level sigma (float or (B,)), conditioned on `cond`
        (batched, at least B rows). guidance_scale > 1 with CFG: uncond and cond in one forward of
        2B (`neg`: the negative prompt's conditioning, batch B or 1); a guidance-distilled model gets
        the scale as its guidance input. Keeps the autograd graph."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        if guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")
        n = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        sigma = sigma.expand(n) if sigma.ndim == 0 else sigma
        if sigma.shape != (n,):
            raise ValueError(f"sigma must be a float or shape ({n},), got {tuple(sigma.shape)}")
        cond = tuple(c[:n] for c in cond)
        if not cls.uses_cfg(bundle):
            return cls.forward(bundle, module, x, sigma, cond, guidance_scale)
        if guidance_scale == 1:
            return cls.forward(bundle, module, x, sigma, cond, None)
        if neg is None:
            raise ValueError(f"guidance_scale={guidance_scale} needs the negative prompt's conditioning "
                             "(rollout.sampler.negative_prompt, encoded with encode_prompts(..., negative_prompt=''))")
        neg = tuple(u[:n] if u.shape[0] >= n else u.expand(n, *u.shape[1:]) for u in neg)
        both = tuple(torch.cat([u, c]) for u, c in zip(neg, cond))
        out = cls.forward(bundle, module, torch.cat([x, x]), torch.cat([sigma, sigma]), both, None)
        uncond, guided = out.chunk(2)
        return cls.combine_cfg(uncond, guided, guidance_scale)

    # -- media ----------------------------------------------------------------------------------
    @classmethod
    def codec(cls, bundle: Any) -> Any:
        """The VAE's latent normalization (a `unirl.stages.models.flow_vae.LatentCodec`)."""
        raise NotImplementedError

    @classmethod
    def decode(cls, bundle: Any, latents: torch.Tensor) -> torch.Tensor:
        """latents (B, *latent) -> uint8 images (B, H, W, 3) or videos (B, F, H, W, 3) on the CPU."""
        return cls.codec(bundle).decode(bundle.vae, latents)

    @classmethod
    def encode_images(cls, bundle: Any, media: Any) -> torch.Tensor:
        """uint8 images (B, H, W, 3) or videos (B, F, H, W, 3) -> float32 latents (B, *latent)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        geo = cls.geometry(bundle)
        media = torch.as_tensor(media) if not isinstance(media, (list, tuple)) else media
        if hasattr(media, "shape"):
            cls.check_image_size(bundle, media.shape[-3], media.shape[-2])
            if geo.video:
                geo.check_frames(int(media.shape[1]))
        return cls.codec(bundle).encode(bundle.vae, media, video=geo.video)

    @classmethod
    def prepare_sft(cls, bundle: Any, cfg: Any, media: Any, *, seed: int, all_reduce: Any, rank: int,
                    world: int) -> dict[str, float]:
        """Before flow-matching SFT: warm the VAE up on the SFT media (a tiny model's VAE is random)
        and set its normalization from their latents; a checkpoint's VAE is kept (`model.vae_warmup`)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.models import flow_vae as S

        warm = cfg.vae_warmup
        steps = warm.resolved_steps(bool(cfg.path))
        if not steps:
            return {}
        codec = cls.codec(bundle)
        info = S.warm_up_vae(bundle.vae, media, steps=steps, lr=warm.lr, batch_size=warm.batch_size, seed=seed,
                             all_reduce=all_reduce, rank=rank, world=world, codec=codec)
        video = cls.geometry(bundle).video
        with torch.no_grad():
            z = torch.cat([codec.to_policy(codec.raw_latents(bundle.vae, codec.pixels(torch.as_tensor(media[i:i + 256]))), video).cpu()
                           for i in range(0, len(media), 256)])
        info.update(codec.fit(bundle.vae, z))
        return info

    # -- the trainable module -------------------------------------------------------------------
    @classmethod
    def transformers(cls, module: Any) -> list[Any]:
        """The diffusers transformers inside the trainable module (one, or several experts)."""
        return [module]

    @classmethod
    def fsdp_units(cls, module: Any) -> list[Any]:
        return [block for t in cls.transformers(module) for name in cls.block_lists for block in getattr(t, name, [])]

    @classmethod
    def lora_what(cls, bundle: Any) -> str:
        return f"the {cls.name} transformer in {bundle.directory}"

    @classmethod
    def add_lora(cls, bundle: Any, lora: Any) -> None:
        add_lora(cls.transformers(bundle.module), rank=lora.rank, alpha=lora.alpha,
                 target_modules=lora.target_modules or cls.lora_targets, what=cls.lora_what(bundle))

    @classmethod
    def reference(cls, bundle: Any) -> AbstractContextManager[Any]:
        return reference_policy(cls.transformers(bundle.module), cls.lora_what(bundle))

    @classmethod
    def split_state(cls, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The trainable module's state by the folder it is written to."""
        return {"transformer": state}

    @classmethod
    def export(cls, bundle: Any, local: Path, state: dict[str, Any], *, lora: Any) -> None:
        if lora is not None:
            state = merge_lora(state, rank=lora.rank, alpha=lora.alpha)
        write_folder(local, base_dir=bundle.directory, vae=bundle.vae, parts=cls.split_state(state))

    # -- the memory estimate --------------------------------------------------------------------
    @classmethod
    def memory_probe(cls, cfg: Any) -> MemoryProbe | None:
        """What `unirl validate --memory` needs of a model of `cfg` (MemoryProbe); None: the family
        is not estimated yet."""
        return None

    @classmethod
    def probe_parts(cls, root: Path) -> tuple[Any, int, int, dict[str, int], int, int]:
        """The folder's transformer on the meta device with its parameters and buffers, the frozen
        models' parameters and buffers by component (text encoders, VAE), the largest block's
        parameters and those outside the blocks."""
        index = read_index(root)
        module, trained, buffers = component_parameters(root, index, "transformer")
        frozen = {name: sum(component_parameters(root, index, name)[1:]) for name in sorted(index)
                  if listed(index, name) and (name.startswith("text_encoder") or name == "vae")}
        sizes = [sum(p.numel() for p in b.parameters()) for b in cls.fsdp_units(module)]
        return module, trained, buffers, frozen, max(sizes, default=0), trained - sum(sizes)

    # -- recipes and folders --------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, directory: Path, tiny: Any) -> Path:
        """The tiny seeded model of `tiny` saved in the family's diffusers layout under `directory`."""
        raise NotImplementedError

    @classmethod
    def materialize(cls, cfg: Any, scratch: Path) -> Path:
        if cfg.path:
            check_pipeline(Path(cfg.path), cls.name, cls.pipelines)
            return Path(cfg.path)
        return cls.build_tiny(scratch, cfg.tiny)

    @classmethod
    def check(cls, recipe: Any) -> None:
        """A folder of another family, an image side the VAE and patch cannot take, a frame count
        the VAE cannot take: errors naming the field, before anything loads."""
        cfg, sampler = recipe.model, recipe.rollout.sampler
        if cfg.path and (Path(cfg.path) / "model_index.json").is_file():
            check_pipeline(Path(cfg.path), cls.name, cls.pipelines)
        geo = cls.recipe_geometry(cfg)
        if geo is None:
            if sampler.num_frames is not None and "video" not in cls.produces:
                raise ValueError(f"rollout.sampler.num_frames: model.kind {cls.name!r} makes images, not videos; remove it")
            return
        if sampler.image_size is not None:
            geo.check_side(sampler.image_size, "rollout.sampler.image_size")
        elif not cfg.path:
            geo.check_side(cfg.tiny.image_size, "model.tiny.image_size")
        if not geo.video:
            if sampler.num_frames is not None:
                raise ValueError(f"rollout.sampler.num_frames: model.kind {cls.name!r} makes images, not videos; remove it")
            return
        if sampler.num_frames is not None:
            geo.check_frames(sampler.num_frames, "rollout.sampler.num_frames")
        elif not cfg.path:
            geo.check_frames(cfg.tiny.num_frames, "model.tiny.num_frames")


def get_flow_family(kind: str) -> type[FlowFamily]:
    """The family registered as `kind`, which a flow policy's recipe (`rollout.kind: flow`) needs to be a FlowFamily."""
    family = get_family(kind)
    if not issubclass(family, FlowFamily):
        raise ValueError(f"model.kind: {kind!r} is not a flow (image or video) family")
    return family

"""The model-family seam: what a family supplies, and the registry that finds it by `model.kind`.

A family is one file under stages/models/ that registers a `Family` subclass:

    @families.register("qwen3")
    class Qwen3(Family):
        config = Qwen3ModelConfig      # the recipe's `model:` section, `kind: Literal["qwen3"]`
        policy = "text"                # the policy it offers (stages/policies/)
        ...

It supplies its config (a tiny seeded architecture or a local Hugging Face / diffusers folder),
`materialize` (the folder a run starts from), `load` -> a bundle (the trainable module, frozen
parts such as text encoders and VAE, the tokenizer), the FSDP2 units, LoRA (default targets, the
adapter-disabled reference) and `export` to a plain HF / diffusers folder. Families are
stateless: every method is a classmethod on the bundle it is given.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import families


def get_family(kind: str) -> type[Family]:
    return families.get(kind)


class Family:
    name: ClassVar[str]
    config: ClassVar[type[Section]]
    # The policy this family's models run as ("text": autoregressive tokens, "flow": flow-matching
    # latents) and the media its samples carry for scorers ("text", "image", "video").
    policy: ClassVar[str]
    # A unified family offers several policies on the same parameters (the recipe's `rollout.kind`
    # picks one; `policy` is the default); empty: just `policy`.
    policies: ClassVar[tuple[str, ...]] = ()
    produces: ClassVar[tuple[str, ...]]
    lora_targets: ClassVar[tuple[str, ...]] = ()
    # Whether its prompts carry images (vision-language models): requests and rollouts then hold
    # each prompt's PNG bytes and patch grids (stages/runtime/images.py).
    takes_images: ClassVar[bool] = False
    # Whether `served_tensors` gives an engine its weights as tensors (a sync through shared
    # memory, rollout.engine.sync.transport shm); else engines load published folders only.
    serves_tensors: ClassVar[bool] = False
    # Modules `load` imports (the model classes: seconds each on a small machine); a worker group
    # launched ahead of its spec imports them while it waits (WorkerGroup.prewarm).
    modules: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def produced_by(cls, policy: str) -> tuple[str, ...]:
        """What a rollout of this family's `policy` produces: a unified family's text policy writes text."""
        return ("text",) if policy == "text" != cls.policy else cls.produces

    @classmethod
    def offers(cls) -> tuple[str, ...]:
        """The policies this family's models run as."""
        return cls.policies or (cls.policy,)

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe of this family; ValueError('field.path: what to do')."""

    @classmethod
    def materialize(cls, cfg: Any, scratch: Path) -> Path:
        """The folder a run starts from: `cfg.path` (checked), or the tiny seeded model saved to
        `scratch` in the same layout a real checkpoint has."""
        raise NotImplementedError

    @classmethod
    def load(cls, directory: Path, cfg: Any, device: Any) -> Any:
        """The bundle of the model in `directory` on `device`; its `.module` is what trains."""
        raise NotImplementedError

    @classmethod
    def load_empty(cls, directory: Path, cfg: Any, device: Any) -> Any:
        """The bundle with its trainable `.module` built on the meta device, for a sharded load
        (stages/train/shards.py fills each rank's shards from `weight_files`); None where the
        family or the folder allows only a whole load."""
        return None

    @classmethod
    def weight_files(cls, directory: Path) -> list[Path]:
        """The safetensors files holding the trainable module's weights under their state-dict
        names (what `load_empty`'s module is filled from)."""
        raise NotImplementedError

    @classmethod
    def fsdp_units(cls, module: Any) -> list[Any]:
        """The submodules FSDP2 shards one by one (decoder layers, transformer blocks)."""
        raise NotImplementedError

    @classmethod
    def add_lora(cls, bundle: Any, lora: Any) -> None:
        """Put LoRA adapters on `bundle.module` (only they stay trainable)."""
        raise NotImplementedError

    @classmethod
    def text_geometry(cls, cfg: Any) -> dict[str, Any] | None:
        """A decoder-only language model's architecture for `unirl validate --memory`
        (stages/run/memory.py `Geometry`'s fields), read without loading it; None: not estimated."""
        return None

    @classmethod
    def reference(cls, bundle: Any) -> AbstractContextManager[Any]:
        """Inside the block `bundle.module` runs as the frozen reference (its adapters disabled)."""
        raise NotImplementedError

    @classmethod
    def export(cls, bundle: Any, local: Path, state: dict[str, Any], *, lora: Any) -> None:
        """Write `state` (the full module state, adapters not yet merged) as a folder that is a
        valid `model.path` for this family."""
        raise NotImplementedError

    @classmethod
    def served_tensors(cls, bundle: Any, state: dict[str, Any], *, lora: Any) -> dict[str, Any]:
        """What an engine's module is loaded with, under the names `weight_files` hold (`state`: the
        full module state, adapters not yet merged; LoRA merged as `export` merges it), for a family
        that `serves_tensors`."""
        raise NotImplementedError

    @classmethod
    def image_grids(cls, cfg: Any, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """A family that `takes_images`: the (t, h, w) patch grid its image processor cuts an image
        of each (width, height) into (stored with the image in requests; the worker checks it
        against the images it decodes)."""
        raise NotImplementedError

    @classmethod
    def image_prompts(cls, bundle: Any, use_chat: bool, device: Any) -> Any:
        """A text family that `takes_images`: what turns a prompt's text and images into token ids
        and the model's extra inputs and positions (stages/models/qwen_vl_prompts.py `ImagePrompts`)."""
        return None

    @classmethod
    def prompt_encoder(cls, directory: Path, chat_template: bool | None) -> Any:
        """A text family that `takes_images`: its `image_prompts` of the model folder `directory`
        without its weights, encoding prompts only (`tokenizer`, `use_chat`, `encode(text, grids,
        tools)`): what an agent's first turn is written with (stages/engines/agentic.py)."""
        return None

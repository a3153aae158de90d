"""`data.name: geneval`: procedural toy-GenEval prompts (objects, colours, counts, positions;
stages/geneval/), for image models; synthetic SFT records are (prompt, rendered scene)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from stages.config_base import Section
from stages.data import Prompt
from stages.seeds import derive_seed
from stages.sources import Source, sources


class GenEvalData(Section):
    """Procedural toy-GenEval prompts (objects, colours, counts, positions)."""

    name: Literal["geneval"] = "geneval"
    seed: int = Field(1234, description="Seed of the prompt stream.")
    heldout_size: int = Field(32, ge=0, description="Held-out prompts used for evaluation.")
    prompts: list[str] = Field(
        default_factory=list,
        description="Train on these prompts (cycled in order, each iteration taking the next ones) instead of the "
        "generated stream; each must parse.",
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


class GenEvalPrompts:
    """Training prompts by (seed, iteration) from the train split, or `prompts` cycled; a fixed
    held-out set from the held-out split. Metadata carries the prompt for the detector."""

    def __init__(self, *, heldout_size: int = 32, seed: int = 0, prompts: list[str] | None = None):
        from stages.geneval.dataset import sample_prompts

        self._sample = sample_prompts
        self.seed = seed
        self.prompts = list(prompts or [])
        texts = sample_prompts(heldout_size, seed, split="heldout") if heldout_size else []
        self._heldout = [Prompt(f"heldout-{i:05d}", t, {"geneval_prompt": t}) for i, t in enumerate(texts)]

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        if self.prompts:
            texts = [self.prompts[(iteration * n + i) % len(self.prompts)] for i in range(n)]
        else:
            texts = self._sample(n, derive_seed(self.seed, "train", iteration) & 0xFFFFFFFF, split="train")
        return [Prompt(f"it{iteration:06d}-{i:05d}", t, {"geneval_prompt": t}) for i, t in enumerate(texts)]


@sources.register("geneval")
class GenEvalSource(Source):
    name = "geneval"
    config = GenEvalData

    @classmethod
    def build(cls, cfg: GenEvalData) -> GenEvalPrompts:
        return GenEvalPrompts(heldout_size=cfg.heldout_size, seed=cfg.seed, prompts=cfg.prompts)

    @classmethod
    def image_size(cls, recipe: Any) -> int | None:
        from stages.models.family import get_family

        return recipe.rollout.sampler.image_size or get_family(recipe.model.kind).image_size(recipe.model)

    @classmethod
    def check(cls, recipe: Any) -> None:
        from stages.geneval.dataset import MIN_IMAGE_SIZE

        from stages.models.family import get_family

        family = get_family(recipe.model.kind)
        if "image" not in family.produces or family.takes_images:
            return  # a model that reads toy-GenEval prompts rather than draws them: its scorers decide what it is paid for
        side = cls.image_size(recipe)
        if side is not None and side < MIN_IMAGE_SIZE:
            raise ValueError(f"rollout.sampler.image_size: toy GenEval needs images of at least {MIN_IMAGE_SIZE} px, got {side}")

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` (prompt, media_png) records at the recipe's image size (the sampler's, else
        the model's own)."""
        from stages.diffusion.sft import geneval_records
        from stages.models.family import get_family

        size = recipe.rollout.sampler.image_size or get_family(recipe.model.kind).native_image_size(recipe.model)
        return geneval_records(recipe.sft.examples, seed=recipe.sft.seed, image_size=int(size))

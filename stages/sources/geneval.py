"""`data.name: geneval`: procedural toy-GenEval prompts (objects, colours, counts, positions;
stages/toys/geneval/), for image models; synthetic SFT records are (prompt, rendered scene)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.family import get_family
from unirl.stages.models.flow_family import get_flow_family
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import ProceduralPrompts, Source, check_listed_prompts
from unirl.stages.toys.geneval.dataset import MIN_IMAGE_SIZE, parse_prompt, sample_prompts, split_of


class GenEvalData(Section):
    """Procedural toy-GenEval prompts (objects, colours, counts, positions)."""

    name: Literal["geneval"] = "geneval"
    seed: int = Field(1234, ge=0, description="Seed of the prompt stream.")
    heldout_size: int = Field(
        32, ge=0, description="Size of each of the dev and test splits (never trained on), drawn with replacement "
        "from toy GenEval's dev and test prompts (78 and 77, every kind in each).")
    kinds: list[Literal["single", "count", "pair", "position"]] = Field(
        ["single", "count", "pair", "position"], min_length=1,
        description="Prompt kinds to draw (each equally often), for training prompts and synthetic SFT records.")
    prompts: list[str] = Field(
        default_factory=list,
        description="Train on these prompts (cycled in order, each iteration taking the next ones) instead of the "
        "generated stream; each must parse and be of the train split.",
    )

    @model_validator(mode="after")
    def _check_prompts(self) -> GenEvalData:
        check_listed_prompts(self.prompts, parse_prompt, split_of)
        return self


@sources.register("geneval")
class GenEvalSource(Source):
    name = "geneval"
    config = GenEvalData

    @classmethod
    def build(cls, cfg: GenEvalData) -> ProceduralPrompts:
        """Prompts whose metadata carries the prompt for the detector."""
        kinds = tuple(cfg.kinds)
        return ProceduralPrompts(lambda n, seed, split: sample_prompts(n, seed, split, kinds=kinds),
                                 heldout_size=cfg.heldout_size, seed=cfg.seed, prompts=cfg.prompts,
                                 meta=lambda text: {"geneval_prompt": text})

    @classmethod
    def image_size(cls, recipe: Any) -> int | None:
        return recipe.rollout.sampler.image_size or get_flow_family(recipe.model.kind).image_size(recipe.model)

    @classmethod
    def check(cls, recipe: Any) -> None:
        family = get_family(recipe.model.kind)
        if "image" not in family.produces or family.takes_images or recipe.rollout.kind != "flow":
            return  # a model that reads toy-GenEval prompts rather than draws them: its scorers decide what it is paid for
        side = cls.image_size(recipe)
        if side is not None and side < MIN_IMAGE_SIZE:
            raise ValueError(f"rollout.sampler.image_size: toy GenEval needs images of at least {MIN_IMAGE_SIZE} px, got {side}")

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` (prompt, media_png) records at the recipe's image size (the sampler's, else
        the model's own); `sft.noise` of them show one object group in another colour."""
        from unirl.stages.diffusion.sft import geneval_records  # start-up time: it loads torch

        size = recipe.rollout.sampler.image_size or get_flow_family(recipe.model.kind).native_image_size(recipe.model)
        return geneval_records(recipe.sft.examples, seed=recipe.sft.seed, image_size=int(size), kinds=tuple(recipe.data.kinds),
                               noise=recipe.sft.noise)

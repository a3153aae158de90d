"""`data.name: toy_vqa`: one-word questions about rendered toy-GenEval scenes (colour, shape,
count, left/right; stages/toys/toy_vqa.py), each prompt carrying its image, for vision-language models."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from unirl.stages.models.family import get_family
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source
from unirl.stages.toys.toy_vqa import ToyVQA


class ToyVQAData(Section):
    """Questions about procedurally drawn scenes; the answer is known from the scene."""

    name: Literal["toy_vqa"] = "toy_vqa"
    kinds: list[Literal["colour", "shape", "count", "position"]] = Field(
        ["colour", "shape", "count", "position"], min_length=1, description="Question kinds to draw from (uniformly).")
    image_size: int = Field(32, ge=16, le=512, description="Side of the square scene images in pixels.")
    heldout_size: int = Field(40, ge=0, description="Size of each of the dev and test splits (never trained on): "
                              "images never trained on, no test image a dev image.")
    seed: int = Field(1234, ge=0, description="Seed of the question stream and the dev and test splits.")


@sources.register("toy_vqa")
class ToyVQASource(Source):
    name = "toy_vqa"
    config = ToyVQAData
    slip: ClassVar[str] = "."  # the imperfect teacher ends some answers with a full stop

    @classmethod
    def build(cls, cfg: ToyVQAData) -> Any:
        return _built(tuple(cfg.kinds), cfg.image_size, cfg.heldout_size, cfg.seed, ToyVQA)

    @classmethod
    def gives_images(cls, cfg: ToyVQAData) -> bool:
        return True

    @classmethod
    def check(cls, recipe: Any) -> None:
        if not get_family(recipe.model.kind).takes_images:
            raise ValueError(f"data.name: toy_vqa prompts show an image, which model.kind {recipe.model.kind!r} cannot "
                             "see; use a vision-language family (qwen2_5_vl, qwen3_vl)")


_CACHE: dict[tuple[Any, ...], Any] = {}


def _built(kinds: tuple[str, ...], size: int, heldout: int, seed: int, make: Any) -> Any:
    """The source is asked for every iteration: its dev and test images are rendered once per process."""
    key = (kinds, size, heldout, seed)
    if key not in _CACHE:
        _CACHE[key] = make(kinds=kinds, image_size=size, heldout_size=heldout, seed=seed)
    return _CACHE[key]

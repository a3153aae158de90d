"""`data.name: videotoy`: procedural toy video prompts (count, colour, direction and speed of
moving squares; stages/toys/videotoy/), for video models; synthetic SFT records are (prompt, rendered
clip), `sft.noise` of them moving the opposite way (an imperfect teacher's slip RL can correct)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.family import get_family
from unirl.stages.models.flow_family import get_flow_family
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.media import to_png_bytes
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import ProceduralPrompts, Source, check_listed_prompts
from unirl.stages.toys.videotoy import make_clips, parse_prompt, sample_prompts, split_of
from unirl.stages.toys.videotoy.dataset import MIN_FRAMES, MIN_SIZE, SPEED_PX, object_side


class VideoToyData(Section):
    """Procedural toy video prompts: "two blue squares moving up quickly"."""

    name: Literal["videotoy"] = "videotoy"
    seed: int = Field(1234, ge=0, description="Seed of the prompt stream.")
    heldout_size: int = Field(
        64, ge=0, description="Size of each of the dev and test splits (never trained on): the grammar's 13 dev (13 test) "
        "prompts, each drawn equally often (to within one).")
    prompts: list[str] = Field(
        default_factory=list,
        description="Train on these prompts (cycled in order) instead of the generated stream; each must parse and be "
        "of the train split.",
    )

    @model_validator(mode="after")
    def _check_prompts(self) -> VideoToyData:
        check_listed_prompts(self.prompts, parse_prompt, split_of)
        return self


@sources.register("videotoy")
class VideoToySource(Source):
    name = "videotoy"
    config = VideoToyData

    @classmethod
    def build(cls, cfg: VideoToyData) -> ProceduralPrompts:
        """Prompts without metadata: the scorer parses the prompt itself."""
        return ProceduralPrompts(sample_prompts, heldout_size=cfg.heldout_size, seed=cfg.seed, prompts=cfg.prompts)

    @classmethod
    def media(cls, recipe: Any) -> tuple[int, int | None]:
        """(frame side, frames) the recipe samples: the sampler's, else the model's own."""
        family, sampler = get_flow_family(recipe.model.kind), recipe.rollout.sampler
        side, frames = family.native_media(recipe.model)
        return sampler.image_size or side, sampler.num_frames or frames

    @classmethod
    def check(cls, recipe: Any) -> None:
        if "video" not in get_family(recipe.model.kind).produces:
            raise ValueError(f"data.name: toy video prompts need a video model; model.kind {recipe.model.kind!r} makes "
                             f"{', '.join(get_family(recipe.model.kind).produces)}")
        if recipe.model.path:
            return
        side, frames = cls.media(recipe)
        where = "rollout.sampler" if recipe.rollout.sampler.image_size or recipe.rollout.sampler.num_frames else "model.tiny"
        if side < MIN_SIZE or frames is None or frames < MIN_FRAMES:
            raise ValueError(f"{where}: toy video clips need a side >= {MIN_SIZE} and >= {MIN_FRAMES} frames, got {side} x {frames}")
        travel = SPEED_PX["quickly"] * side / 16 * (frames - 1)
        if travel > side - object_side(side):
            raise ValueError(f"{where}: a quick square crosses a {side}-pixel frame in fewer than {frames} frames; "
                             "use fewer frames or a larger image_size")

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` (prompt, media_frames) records at the recipe's frame side and count;
        `sft.noise` of them move the opposite way."""
        side, frames = cls.media(recipe)
        assert frames is not None, "a toy video recipe has frames (its check)"
        clips = make_clips(recipe.sft.examples, recipe.sft.seed, size=int(side), frames=int(frames),
                           reverse_fraction=recipe.sft.noise)
        return [{"prompt": p, "media_frames": to_png_bytes(c)} for p, c in clips]

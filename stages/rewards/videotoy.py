"""`videotoy`: the toy video reward (stages/toys/videotoy/detector.py), a clip against its prompt.

mode "strict": 1 when the clip shows the prompt's number of squares of its colour in every frame,
moving the stated way at the stated speed, else 0; mode "mean": the mean of colour, count,
direction and speed (a denser signal); mode "motion": the mean of strict, direction and speed, for
a model that already draws the right squares (colour and count credit nothing about motion, and
a mean over them lets RL trade motion for them). Components are logged either way: strict,
object, colour, count, direction, speed."""
from __future__ import annotations

from typing import Literal

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer
from unirl.stages.toys.videotoy import parse_prompt, score

VIDEOTOY_MODE_PARTS = {"strict": ("strict",), "mean": ("colour", "count", "direction", "speed"),
                       "motion": ("strict", "direction", "speed")}


@register_scorer("videotoy", reads=("video",))
class VideoToyScorer:
    """Needs batch.videos (N lists of PIL frames); params: mode (strict | mean | motion)."""

    name = "videotoy"

    @staticmethod
    def check_prompt(text: str) -> None:
        parse_prompt(text)

    def __init__(self, mode: Literal["strict", "mean", "motion"] = "strict") -> None:
        if mode not in VIDEOTOY_MODE_PARTS:
            raise ValueError(f"videotoy mode {mode!r} is not one of {', '.join(VIDEOTOY_MODE_PARTS)}")
        self.mode = mode

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.videos is None:
            raise ValueError("scorer 'videotoy' needs videos (ScoreBatch.videos) and the batch has none")
        results = [score(frames, prompt).as_dict() for frames, prompt in zip(batch.videos, batch.prompts)]
        return ScoreResult.mean_of(results, VIDEOTOY_MODE_PARTS[self.mode])

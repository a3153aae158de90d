"""Image scorers: toy GenEval, JPEG (in)compressibility (as in DDPO), brightness, colorfulness.

Every scorer reads `ScoreBatch.images` (PIL RGB images, one per sample) and returns one float
per sample. Values are raw (not standardised): advantages are normalised per group later, so a
constant offset or scale in a reward does not change the policy gradient of a single scorer,
but does change its weight in a `weighted_sum` with other scorers.
"""
from __future__ import annotations

import io
from typing import Any, Literal

import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer
from unirl.stages.toys.geneval import parse_prompt, score

# The components each geneval mode averages into the reward.
GENEVAL_MODE_PARTS = {
    "strict": ("strict",),
    "mean": ("object", "colour", "count", "position"),
    "partial": ("strict", "colour", "count", "position"),
}
GENEVAL_MODES = tuple(GENEVAL_MODE_PARTS)


def _images(batch: ScoreBatch, scorer: str) -> list[Any]:
    if batch.images is None:
        raise ValueError(f"scorer {scorer!r} scores images, but the batch has none (ScoreBatch.images is None)")
    return batch.images


def _rgb(image: Any) -> np.ndarray:
    """(H, W, 3) float64 in [0, 255]."""
    if hasattr(image, "convert"):
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float64)


@register_scorer("geneval", reads=("image",))
class GenEvalScorer:
    """Toy GenEval (unirl.stages.toys.geneval): the image against its sample's intent, the prompt's
    `geneval_prompt` metadata where it has one (a pipeline's user prompt said in other words,
    stages/sources/pe_geneval.py), else the prompt itself.
    mode "strict": 1 when object, colour, count and position all hold, else 0 (GenEval's score);
    mode "mean": the mean of the four components (a denser signal, but `object` credits a shape
    drawn in the wrong colour); mode "partial": the mean of strict, colour (shape and colour
    right), count and position, so every credited part asks for the right colour. Components
    are logged either way: strict, object, colour, count, position."""

    name = "geneval"

    @staticmethod
    def check_prompt(text: str) -> None:
        parse_prompt(text)

    def __init__(self, mode: Literal["strict", "mean", "partial"] = "strict") -> None:
        if mode not in GENEVAL_MODES:
            raise ValueError(f"geneval mode {mode!r} is not one of {', '.join(GENEVAL_MODES)}")
        self.mode = mode

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        images = _images(batch, self.name)
        metadata = batch.metadata or [{}] * len(images)
        intents = [meta.get("geneval_prompt") or prompt for prompt, meta in zip(batch.prompts, metadata)]
        results = [score(image, intent).as_dict() for image, intent in zip(images, intents)]
        return ScoreResult.mean_of(results, GENEVAL_MODE_PARTS[self.mode])


def jpeg_kilobytes(image: Any, quality: int = 95) -> float:
    """Size of the image saved as JPEG at `quality`, in kB (1 kB = 1000 bytes), headers included
    (about 0.6 kB at any resolution, a constant that group advantages cancel)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


@register_scorer("jpeg_compressibility", reads=("image",))
class JpegCompressibility:
    """DDPO's compressibility reward: -(JPEG size in kB at quality 95). Higher = smaller file.
    Not normalised by resolution: compare only images of one size."""

    name = "jpeg_compressibility"
    sign = -1.0

    def __init__(self, quality: int = 95) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"{self.name}: JPEG quality must be in 1..100, got {quality}")
        self.quality = quality

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        kb = np.array([jpeg_kilobytes(im, self.quality) for im in _images(batch, self.name)], dtype=np.float64)
        return ScoreResult(self.sign * kb, {"jpeg_kb": kb})


@register_scorer("jpeg_incompressibility", reads=("image",))
class JpegIncompressibility(JpegCompressibility):
    """DDPO's incompressibility reward: +(JPEG size in kB at quality 95)."""

    name = "jpeg_incompressibility"
    sign = 1.0


@register_scorer("brightness", reads=("image",))
class Brightness:
    """Mean luma in [0, 1]: (0.299 R + 0.587 G + 0.114 B) / 255 (ITU-R BT.601), averaged over pixels."""

    name = "brightness"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        weights = np.array([0.299, 0.587, 0.114])
        values = [float((_rgb(im) @ weights).mean() / 255.0) for im in _images(batch, self.name)]
        return ScoreResult(np.array(values, dtype=np.float64))


@register_scorer("colorfulness", reads=("image",))
class Colorfulness:
    """Hasler & Suesstrunk (2003) colourfulness, divided by 255: with rg = R - G and
    yb = (R + G) / 2 - B over pixels, M = sqrt(std(rg)^2 + std(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2).
    0 for any grey image; about 0.4-0.7 for saturated colour fields."""

    name = "colorfulness"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        values = []
        for im in _images(batch, self.name):
            rgb = _rgb(im)
            rg = rgb[..., 0] - rgb[..., 1]
            yb = 0.5 * (rgb[..., 0] + rgb[..., 1]) - rgb[..., 2]
            m = np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean())
            values.append(float(m / 255.0))
        return ScoreResult(np.array(values, dtype=np.float64))

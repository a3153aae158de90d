"""The toy video detector: per frame, the squares of each palette colour (toy GenEval's pixel
classes and 4-connected components, stages/toys/geneval/detector.py); across frames, the path of the
prompt's colour. Numpy only, deterministic.

Per clip and prompt (fractions in [0, 1]):
  object     frames with any object at all;
  colour     frames with an object of the prompt's colour;
  count      frames with exactly the prompt's number of objects of that colour;
  direction  1 when that colour's centroid moves along the prompt's direction: its displacement
             from the first to the last frame points that way and mostly along that axis;
  speed      1 when its speed along the axis, pixels per frame, is in the prompt's band
             (slowly: 0.5-1.5, quickly: 1.5-3 at a 16-pixel side, scaled with the side);
  strict     1 when every one of them holds fully.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from unirl.stages.toys.geneval.detector import COLOUR_NAMES, classify_pixels, connected_components
from unirl.stages.toys.videotoy.dataset import DIRECTIONS, ClipSpec, parse_prompt

# Bands of speed along the axis, in pixels per frame at a 16-pixel side: between the two speeds'
# midpoint, half the slow speed above a standstill, and half again the fast speed.
SPEED_BANDS = {"slowly": (0.5, 1.5), "quickly": (1.5, 3.0)}
# Movement across the axis may be at most this fraction of the movement along it.
MAX_CROSS = 0.5


@dataclass(frozen=True)
class ClipScore:
    strict: float
    object: float
    colour: float
    count: float
    direction: float
    speed: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _frame(image: Any) -> np.ndarray:
    rgb = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.float32)
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise ValueError(f"expected RGB frames (H, W, 3), got shape {rgb.shape}")
    return rgb


def frame_objects(image: Any, min_area: int | None = None) -> dict[str, list[tuple[float, float, int]]]:
    """Colour -> its objects in one frame as (centre x, centre y, area); components smaller than
    `min_area` (default 1.5% of the frame, at least 3 px) are noise."""
    rgb = _frame(image)
    h, w = rgb.shape[:2]
    min_area = max(3, round(0.015 * h * w)) if min_area is None else min_area
    classes = classify_pixels(rgb)
    out: dict[str, list[tuple[float, float, int]]] = {}
    for ci, colour in enumerate(COLOUR_NAMES):
        labels, n = connected_components(classes == ci)
        areas = np.bincount(labels[labels >= 0], minlength=n)
        for k in np.flatnonzero(areas >= min_area):
            ys, xs = np.nonzero(labels == k)
            out.setdefault(colour, []).append((float(xs.mean()), float(ys.mean()), int(areas[k])))
    return out


def score(frames: Any, prompt: str | ClipSpec) -> ClipScore:
    """How well a clip (a list of PIL frames or uint8 (F, H, W, 3)) follows its prompt."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    frames = list(frames)
    if len(frames) < 2:
        raise ValueError(f"a toy video clip needs at least 2 frames to show motion, got {len(frames)}")
    found = [frame_objects(f) for f in frames]
    side = _frame(frames[0]).shape[1]
    mine = [f.get(spec.colour, []) for f in found]
    object_ = float(np.mean([bool(f) for f in found]))
    colour = float(np.mean([bool(m) for m in mine]))
    count = float(np.mean([len(m) == spec.count for m in mine]))
    direction = speed = 0.0
    seen = [t for t, m in enumerate(mine) if m]
    if len(seen) >= 2 and seen[0] == 0 and seen[-1] == len(frames) - 1:
        def centre(objs: list[tuple[float, float, int]]) -> np.ndarray:
            weights = np.array([a for _, _, a in objs], dtype=np.float64)
            return np.array([[x, y] for x, y, _ in objs]).T @ weights / weights.sum()

        moved = centre(mine[-1]) - centre(mine[0])
        axis = np.array(DIRECTIONS[spec.direction], dtype=np.float64)
        along = float(moved @ axis)
        cross = float(abs(moved @ axis[::-1]))
        if along > 0 and cross <= MAX_CROSS * along:
            direction = 1.0
        per_frame = along / (len(frames) - 1) * 16 / side
        lo, hi = SPEED_BANDS[spec.speed]
        speed = float(direction == 1.0 and lo <= per_frame < hi)
    strict = float(min(object_, colour, count, direction, speed) == 1.0)
    return ClipScore(strict, object_, colour, count, direction, speed)

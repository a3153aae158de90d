"""Toy video prompts and clips: `count` squares of one colour moving in one direction at one speed
over a white background.

    prompt := count colour shape 'moving' direction speed
    count  := a | two            colour := red | green | blue | yellow (toy GenEval's palette)
    shape  := square | squares   direction := left | right | up | down   speed := slowly | quickly

A slow square moves `SPEED_PX['slowly']` pixels per frame, a quick one `SPEED_PX['quickly']`
(for a 16-pixel frame; they scale with the frame side). The grammar has 64 prompts; a fixed 35% by
text hash are held out (26), so held-out prompts are unseen combinations of seen words. They are
partitioned once more, in the order of a second hash alternately, into `dev` (13 prompts: what
recipes are tuned on) and `test` (13: reported after RL); a held-out set draws each of its split's
prompts equally often, so its score weighs every prompt alike. `render` draws
a clip the detector (stages/toys/videotoy/detector.py) scores 1.0 against its own prompt; with
`reverse` it draws the same clip moving the opposite way: an imperfect teacher's slip, which the
SFT data of the video quickstart carries for a fraction of its demonstrations.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass

import numpy as np

from unirl.stages.toys.geneval.dataset import BACKGROUND, COLOURS

COUNTS = {"a": 1, "two": 2}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
SPEEDS = ("slowly", "quickly")
# Pixels per frame at a 16-pixel frame side (scaled with the side).
SPEED_PX = {"slowly": 1.0, "quickly": 2.0}
SPLITS = ("train", "heldout", "dev", "test")  # dev and test partition heldout
# 35%: 13 dev and 13 test prompts. At 20% (8 and 7) a split's score was a handful of prompts' and
# the same model landed 10 points apart on dev and test (benchmarks/README.md, "Video quickstart").
HELDOUT_PERCENT = 35
MIN_SIZE, MIN_FRAMES = 12, 2
WORDS = tuple(sorted({*COUNTS, *COLOURS, "square", "squares", "moving", *DIRECTIONS, *SPEEDS}))
_PATTERN = re.compile(r"^(a|two) (\w+) (squares?) moving (\w+) (\w+)$")


@dataclass(frozen=True)
class ClipSpec:
    count: int
    colour: str
    direction: str
    speed: str

    @property
    def text(self) -> str:
        noun = "square" if self.count == 1 else "squares"
        return f"{'a' if self.count == 1 else 'two'} {self.colour} {noun} moving {self.direction} {self.speed}"


def parse_prompt(text: str) -> ClipSpec:
    """The clip a prompt asks for; ValueError saying the grammar otherwise."""
    m = _PATTERN.match(text.strip().rstrip(".").lower())
    grammar = (f"'<a|two> <{'|'.join(COLOURS)}> <square|squares> moving <{'|'.join(DIRECTIONS)}> <{'|'.join(SPEEDS)}>'")
    if not m:
        raise ValueError(f"cannot parse toy video prompt {text!r}: expected {grammar}")
    count_word, colour, noun, direction, speed = m.groups()
    count = COUNTS[count_word]
    if colour not in COLOURS or direction not in DIRECTIONS or speed not in SPEEDS or (noun == "squares") != (count > 1):
        raise ValueError(f"cannot parse toy video prompt {text!r}: expected {grammar}")
    return ClipSpec(count, colour, direction, speed)


def split_of(text: str) -> str:
    """The fixed split of a prompt: `heldout` for HELDOUT_PERCENT% of prompts by text hash."""
    digest = hashlib.sha256(parse_prompt(text).text.encode()).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT else "train"


@functools.cache
def _prompts(split: str | None) -> tuple[str, ...]:
    if split in ("dev", "test"):
        order = sorted(_prompts("heldout"), key=lambda t: hashlib.sha256(f"dev/test {t}".encode()).digest())
        half = set(order[0::2] if split == "dev" else order[1::2])
        return tuple(t for t in _prompts("heldout") if t in half)
    specs = [ClipSpec(n, c, d, s) for n, c, d, s in itertools.product(COUNTS.values(), COLOURS, DIRECTIONS, SPEEDS)]
    return tuple(s.text for s in specs if split is None or split_of(s.text) == split)


def all_prompts(split: str | None = None) -> list[str]:
    """Every prompt of the grammar (a fixed order), optionally of one split."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (allowed: {', '.join(SPLITS)})")
    return list(_prompts(split))


def sample_prompts(n: int, seed: int, split: str = "train") -> list[str]:
    """n prompts of `split`: training prompts drawn uniformly with replacement; held-out ones
    (`heldout`, `dev`, `test`) in seeded rounds that each hold every prompt of the split once, so
    each prompt comes equally often (to within one)."""
    pool = all_prompts(split)
    rng = np.random.default_rng(seed)
    if split == "train":
        return [pool[i] for i in rng.integers(len(pool), size=n)]
    rounds = -(-n // len(pool))
    return [pool[i] for _ in range(rounds) for i in rng.permutation(len(pool))][:n]


def speed_px(speed: str, size: int) -> float:
    return SPEED_PX[speed] * size / 16


def object_side(size: int) -> int:
    """Squares are 3/8 of the frame side (6 px at 16): large enough for a tiny VAE to learn them
    within its warm-up (at 4 px its reconstructions lost them), small enough that a quick square
    stays in frame for 5 frames."""
    return max(3, round(size * 3 / 8))


def trajectory(spec: ClipSpec, size: int, frames: int, rng: np.random.Generator) -> list[list[tuple[float, float]]]:
    """Top-left corners (x, y) of each square at each frame: along the motion axis the start leaves
    room for the whole path; two squares sit apart across it."""
    side, step = object_side(size), speed_px(spec.speed, size)
    dx, dy = DIRECTIONS[spec.direction]
    travel = step * (frames - 1)
    free = size - side - travel
    if free < 0:
        raise ValueError(f"a square moving {spec.speed} leaves a {size}-pixel frame within {frames} frames; use fewer frames "
                         "or a larger frame side")
    start_along = float(rng.uniform(0, free)) + (travel if dx + dy < 0 else 0.0)
    gap = max(1, side // 2)
    if size < spec.count * side + (spec.count - 1) * gap:
        raise ValueError(f"{spec.count} squares do not fit side by side in a {size}-pixel frame")
    span = spec.count * side + (spec.count - 1) * gap
    across0 = float(rng.integers(0, size - span + 1))
    out = []
    for t in range(frames):
        along = start_along + (dx + dy) * step * t
        corners = []
        for k in range(spec.count):
            across = across0 + k * (side + gap)
            corners.append((along, across) if dx else (across, along))
        out.append(corners)
    return out


def render(spec: ClipSpec | str, size: int = 16, frames: int = 5, seed: int = 0, *, reverse: bool = False) -> np.ndarray:
    """uint8 (frames, size, size, 3): the clip a prompt describes (crisp squares on white). The
    path is a function of (prompt, size, frames, seed); `reverse` draws it moving the other way."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if size < MIN_SIZE or frames < MIN_FRAMES:
        raise ValueError(f"toy video clips need a side >= {MIN_SIZE} and >= {MIN_FRAMES} frames, got {size} x {frames}")
    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha256(spec.text.encode()).digest()[:4], "big")])
    drawn = ClipSpec(spec.count, spec.colour, OPPOSITE[spec.direction], spec.speed) if reverse else spec
    side = object_side(size)
    clip = np.empty((frames, size, size, 3), dtype=np.uint8)
    clip[:] = BACKGROUND
    for t, corners in enumerate(trajectory(drawn, size, frames, rng)):
        for x, y in corners:
            x0, y0 = int(round(x)), int(round(y))
            clip[t, y0:y0 + side, x0:x0 + side] = COLOURS[spec.colour]
    return clip


def make_clips(n: int, seed: int, *, split: str = "train", size: int = 16, frames: int = 5,
               reverse_fraction: float = 0.0) -> list[tuple[str, np.ndarray]]:
    """n (prompt, clip) demonstrations; clip i is drawn with seed (seed, i), and a `reverse_fraction`
    of them (chosen by a generator seeded from `seed`) move the opposite way."""
    prompts = sample_prompts(n, seed, split)
    slips = np.random.default_rng([seed, 7]).random(n) < reverse_fraction
    return [(p, render(p, size, frames, seed=seed * 1_000_003 + i, reverse=bool(r))) for i, (p, r) in enumerate(zip(prompts, slips))]

"""Toy VQA: one-word questions about toy-GenEval scenes (coloured circles, squares and triangles on
white, rendered by stages/toys/geneval/dataset.py), whose answers are known from the scene drawn.

    kind      scene                          question                                         answer
    colour    one object                     what colour is the circle?                       red
    shape     one object                     what shape is the red object?                    circle
    count     1-3 identical objects          how many shapes are there?                       2
    position  two objects side by side       is the red circle left or right of the blue square?   left

Every question has exactly one right answer (`render` lays a position scene out so that only the
named relation holds). An instance is (kind, scene, layout seed); the training stream draws
layout seeds below 2**31 from (seed, iteration), the dev split renders its scenes with layout
seeds from 2**31 up and the test split with seeds from 2**31 + 2**30 up. Different seeds can
still lay a small scene out the same way, so images are compared too: a test image equal to a
dev one, or a training image equal to either, is drawn again with the next layout seed of its
range. No dev or test image is ever trained on, no test image is a dev image, and both splits
are the same for every run of a recipe (they depend on `seed`, `kinds`, `image_size` and their
size only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from unirl.stages.runtime.data import Prompt, check_split
from unirl.stages.runtime.images import png_bytes
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.toys.geneval.dataset import COLOURS, SHAPES, ObjectSpec, PromptSpec, render

if TYPE_CHECKING:
    from unirl.stages.toys.geneval.dataset import PromptSpec

KINDS = ("colour", "shape", "count", "position")
HELDOUT_SEEDS = 2**31  # dev layouts: [2**31, 2**31 + 2**30); training layouts are below
TEST_SEEDS = HELDOUT_SEEDS + 2**30  # test layouts: [2**31 + 2**30, 2**32)
RELAYOUTS = 1000  # layouts tried for a scene whose image is taken (by a held-out split) before giving up
SIDES = {"on the left of": "left", "on the right of": "right"}


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    scene: PromptSpec


def make_question(kind: str, rng: np.random.Generator) -> Question:
    """A question of `kind` about a scene drawn with `rng` (uniform over the grammar's choices)."""
    colours, shapes = list(COLOURS), list(SHAPES)
    colour, shape = colours[rng.integers(len(colours))], shapes[rng.integers(len(shapes))]
    if kind == "colour":
        return Question(kind, f"what colour is the {shape}?", colour, PromptSpec((ObjectSpec(shape, colour),)))
    if kind == "shape":
        return Question(kind, f"what shape is the {colour} object?", shape, PromptSpec((ObjectSpec(shape, colour),)))
    if kind == "count":
        n = int(rng.integers(1, 4))
        return Question(kind, "how many shapes are there?", str(n), PromptSpec((ObjectSpec(shape, colour, n),)))
    if kind == "position":
        while True:
            other = (shapes[rng.integers(len(shapes))], colours[rng.integers(len(colours))])
            if other != (shape, colour):
                break
        relation = list(SIDES)[rng.integers(len(SIDES))]
        text = f"is the {colour} {shape} left or right of the {other[1]} {other[0]}?"
        return Question(kind, text, SIDES[relation],
                        PromptSpec((ObjectSpec(shape, colour), ObjectSpec(other[0], other[1])), relation))
    raise ValueError(f"unknown toy VQA question kind {kind!r} (allowed: {', '.join(KINDS)})")


class ToyVQA:
    """Training questions by (seed, iteration); fixed dev and test splits. A prompt's metadata holds
    the `answer` (for exact_match), its `kind` and the `scene` drawn; its image is PNG bytes."""

    def __init__(self, *, kinds: tuple[str, ...] = KINDS, image_size: int = 32, heldout_size: int = 40, seed: int = 0):
        self.kinds, self.size, self.seed = tuple(kinds), image_size, seed
        dev = [self._prompt(f"heldout-{i:05d}", derive_seed(seed, "heldout", i), HELDOUT_SEEDS + i, HELDOUT_SEEDS)
               for i in range(heldout_size)]
        dev_images = {p.images for p in dev}
        test = [self._prompt(f"test-{i:05d}", derive_seed(seed, "test", i), TEST_SEEDS + i, TEST_SEEDS, dev_images)
                for i in range(heldout_size)]
        self._splits = {"dev": dev, "test": test}
        self._held_images = dev_images | {p.images for p in test}

    def _prompt(self, prompt_id: str, draw_seed: int, layout_seed: int, lo: int,
                avoid: set[tuple[bytes, ...]] | frozenset = frozenset()) -> Prompt:
        """The question drawn with `draw_seed`, its scene laid out with `layout_seed`, or with the
        next seeds of its range while the image is one of `avoid` (the range: [0, 2**31) for
        training, lo = 0; [lo, lo + 2**30) for a held-out split)."""
        rng = np.random.default_rng(draw_seed)
        q = make_question(self.kinds[rng.integers(len(self.kinds))], rng)
        span = HELDOUT_SEEDS if lo == 0 else 2**30
        for k in range(RELAYOUTS):
            images = (png_bytes(render(q.scene, self.size, seed=lo + (layout_seed - lo + k) % span)),)
            if images not in avoid:
                return Prompt(prompt_id, q.text, {"answer": q.answer, "kind": q.kind, "scene": q.scene.text}, images)
        raise ValueError(f"data.heldout_size: the dev and test splits take every layout of {q.scene.text!r} at "
                         f"{self.size} px that {RELAYOUTS} seeds give; lower data.heldout_size or raise data.image_size")

    def heldout(self, split: str = "dev") -> list[Prompt]:
        """The fixed `dev` or `test` split: images never in `batch`, no test image a dev image."""
        return list(self._splits[check_split(split)])

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        out = []
        for j in range(n):
            seed = derive_seed(self.seed, "train", iteration, j)
            out.append(self._prompt(f"it{iteration:06d}-{j:05d}", seed, seed % HELDOUT_SEEDS, 0, self._held_images))
        return out

"""Toy VQA: one-word questions about toy-GenEval scenes (coloured circles, squares and triangles on
white, rendered by stages/geneval/dataset.py), whose answers are known from the scene drawn.

    kind      scene                          question                                         answer
    colour    one object                     what colour is the circle?                       red
    shape     one object                     what shape is the red object?                    circle
    count     1-3 identical objects          how many shapes are there?                       2
    position  two objects side by side       is the red circle left or right of the blue square?   left

Every question has exactly one right answer (`render` lays a position scene out so that only the
named relation holds). An instance is (kind, scene, layout seed); the training stream draws
layout seeds below 2**31 from (seed, iteration), the held-out split renders its scenes with
seeds from 2**31 up, so no held-out image is ever trained on, and it is the same for every run
of a recipe (it depends on `seed` and its size only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.data import Prompt
from stages.seeds import derive_seed

KINDS = ("colour", "shape", "count", "position")
HELDOUT_SEEDS = 2**31
SIDES = {"on the left of": "left", "on the right of": "right"}


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    scene: object  # stages.geneval.dataset.PromptSpec


def make_question(kind: str, rng: np.random.Generator) -> Question:
    """A question of `kind` about a scene drawn with `rng` (uniform over the grammar's choices)."""
    from stages.geneval.dataset import COLOURS, SHAPES, ObjectSpec, PromptSpec

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
    """Training questions by (seed, iteration); a fixed held-out split. A prompt's metadata holds
    the `answer` (for exact_match), its `kind` and the `scene` drawn; its image is PNG bytes."""

    def __init__(self, *, kinds: tuple[str, ...] = KINDS, image_size: int = 32, heldout_size: int = 40, seed: int = 0):
        self.kinds, self.size, self.seed = tuple(kinds), image_size, seed
        self._heldout = [self._prompt(f"heldout-{i:05d}", derive_seed(seed, "heldout", i), HELDOUT_SEEDS + i)
                         for i in range(heldout_size)]

    def _prompt(self, prompt_id: str, draw_seed: int, layout_seed: int) -> Prompt:
        from stages.geneval.dataset import render
        from stages.images import png_bytes

        rng = np.random.default_rng(draw_seed)
        q = make_question(self.kinds[rng.integers(len(self.kinds))], rng)
        image = render(q.scene, self.size, seed=layout_seed)
        return Prompt(prompt_id, q.text, {"answer": q.answer, "kind": q.kind, "scene": q.scene.text}, (png_bytes(image),))

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        out = []
        for j in range(n):
            seed = derive_seed(self.seed, "train", iteration, j)
            out.append(self._prompt(f"it{iteration:06d}-{j:05d}", seed, seed % HELDOUT_SEEDS))
        return out

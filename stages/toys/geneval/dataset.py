"""Toy GenEval prompts and scenes: coloured circles, squares and triangles on a white background.

The grammar is small enough to enumerate, so the train / held-out split is a fixed property of
each prompt's text (a hash), not of any seed: every run, recipe and benchmark holds out the same
prompts: HELDOUT_PERCENT% of each kind by hash, and at least MIN_HELDOUT_PER_KIND of a kind (the
next prompts in hash order), so the 12 single-object prompts give four. The held-out prompts are
partitioned once more, into `dev` (what recipes are tuned on) and `test` (reported after RL): each
kind's held-out prompts, in the order of a second hash, go alternately to dev and test, so each
half has every kind. `render` draws a scene that the detector in `unirl.stages.toys.geneval.detector` scores 1.0 (strict)
against its own prompt, so the SFT data and the RL reward speak the same language.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
# Saturated, far apart in RGB and far from the white background, so a blurry generated pixel
# still lands nearest to the colour that was meant.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 160, 20),
    "blue": (20, 40, 220),
    "yellow": (240, 210, 0),
}
BACKGROUND = (255, 255, 255)
COUNT_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
NUMBER_NAMES = {1: "a", 2: "two", 3: "three"}
RELATIONS = ("on the left of", "on the right of", "above", "below")
KINDS = ("single", "count", "pair", "position")
SPLITS = ("train", "heldout", "dev", "test")  # dev and test partition heldout
HELDOUT_PERCENT = 20
MIN_HELDOUT_PER_KIND = 4  # two for dev, two for test
MIN_IMAGE_SIZE = 16

GRAMMAR = (
    "prompt := group | group 'and' group | group relation group; "
    "group := count colour shape; count := a|one|two|three; "
    f"colour := {'|'.join(COLOURS)}; shape := {'|'.join(SHAPES)} (plural with 's'); "
    f"relation := {'|'.join(RELATIONS)} (one object on each side); "
    "an optional leading 'a photo of' and a trailing '.' are ignored"
)

# Every word a prompt can contain, for tokenizers that want one token per word.
WORDS = tuple(
    sorted(
        set(COUNT_WORDS) | set(COLOURS) | set(SHAPES) | {s + "s" for s in SHAPES} | {"and", "photo"}
        | {w for r in RELATIONS for w in r.split()}
    )
)


@dataclass(frozen=True)
class ObjectSpec:
    """One group of identical objects: `count` x (`colour`, `shape`)."""

    shape: str
    colour: str
    count: int = 1

    @property
    def text(self) -> str:
        noun = self.shape if self.count == 1 else self.shape + "s"
        return f"{NUMBER_NAMES[self.count]} {self.colour} {noun}"


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for: one or two object groups and, for position prompts, the relation
    of the first object to the second (`"above"` means the first is above the second)."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    @property
    def kind(self) -> str:
        if self.relation is not None:
            return "position"
        if len(self.objects) == 2:
            return "pair"
        return "single" if self.objects[0].count == 1 else "count"

    @property
    def text(self) -> str:
        if len(self.objects) == 1:
            return self.objects[0].text
        joint = self.relation if self.relation is not None else "and"
        return f"{self.objects[0].text} {joint} {self.objects[1].text}"


def _parse_error(text: str, reason: str) -> ValueError:
    return ValueError(f"cannot parse toy-GenEval prompt {text!r}: {reason}. Grammar: {GRAMMAR}")


def parse_prompt(text: str) -> PromptSpec:
    """Prompt text -> `PromptSpec`; a prompt outside `GRAMMAR` raises ValueError naming it."""
    if not isinstance(text, str):
        raise _parse_error(str(text), f"expected a string, got {type(text).__name__}")
    words = re.sub(r"\s+", " ", text.strip().lower().rstrip(".")).split(" ")
    if words[:3] == ["a", "photo", "of"]:
        words = words[3:]
    pos = 0

    def group() -> ObjectSpec:
        nonlocal pos
        if len(words) - pos < 3:
            raise _parse_error(text, f"expected 'count colour shape' at word {pos + 1}")
        count_word, colour, noun = words[pos : pos + 3]
        if count_word not in COUNT_WORDS:
            raise _parse_error(text, f"{count_word!r} is not a count")
        if colour not in COLOURS:
            raise _parse_error(text, f"{colour!r} is not a known colour")
        shape = noun[:-1] if noun.endswith("s") and noun[:-1] in SHAPES else noun
        if shape not in SHAPES:
            raise _parse_error(text, f"{noun!r} is not a known shape")
        pos += 3
        return ObjectSpec(shape, colour, COUNT_WORDS[count_word])

    first = group()
    if pos == len(words):
        return PromptSpec((first,))
    rest = " ".join(words[pos:])
    if rest.startswith("and "):
        pos += 1
        relation = None
    else:
        relation = next((r for r in RELATIONS if rest.startswith(r + " ")), None)
        if relation is None:
            raise _parse_error(text, f"expected 'and' or a relation after {first.text!r}")
        pos += len(relation.split())
    second = group()
    if pos != len(words):
        raise _parse_error(text, f"unexpected words after the second object: {' '.join(words[pos:])!r}")
    if (first.shape, first.colour) == (second.shape, second.colour):
        raise _parse_error(text, "it names the same coloured shape twice")
    if relation is not None and (first.count, second.count) != (1, 1):
        raise _parse_error(text, "a position prompt takes one object on each side")
    return PromptSpec((first, second), relation)


def split_of(text: str) -> str:
    """The fixed split of a prompt: `heldout` or `train` (see the module docstring)."""
    return "heldout" if parse_prompt(text).text in _heldout() else "train"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


@functools.cache
def _heldout() -> frozenset[str]:
    """Every held-out prompt: per kind, those whose hash falls in HELDOUT_PERCENT%, topped up to
    MIN_HELDOUT_PER_KIND with the next ones in (hash % 100, hash) order."""
    held: set[str] = set()
    for kind in KINDS:
        order = sorted(_prompts(kind, None), key=lambda t: (_hash(t) % 100, _hash(t)))
        below = sum(_hash(t) % 100 < HELDOUT_PERCENT for t in order)
        held.update(order[: max(below, MIN_HELDOUT_PER_KIND)])
    return frozenset(held)


@functools.cache
def _heldout_halves() -> dict[str, str]:
    """Held-out prompt -> `dev` or `test` (see the module docstring)."""
    halves: dict[str, str] = {}
    for kind in KINDS:
        order = sorted(_prompts(kind, "heldout"), key=lambda t: hashlib.sha256(f"dev/test {t}".encode()).digest())
        halves.update((t, "dev" if i % 2 == 0 else "test") for i, t in enumerate(order))
    return halves


def all_prompts(kind: str | None = None, split: str | None = None) -> list[str]:
    """Every prompt of the grammar in canonical form (a fixed order), optionally one kind/split."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown prompt kind {kind!r} (allowed: {', '.join(KINDS)})")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (allowed: {', '.join(SPLITS)})")
    return list(_prompts(kind, split))


@functools.cache
def _prompts(kind: str | None, split: str | None) -> tuple[str, ...]:
    """all_prompts, computed once per (kind, split): every iteration samples from these pools."""
    singles = [ObjectSpec(s, c) for c in COLOURS for s in SHAPES]
    specs: list[PromptSpec] = []
    specs += [PromptSpec((o,)) for o in singles]
    specs += [PromptSpec((ObjectSpec(o.shape, o.colour, n),)) for n in (2, 3) for o in singles]
    pairs = list(itertools.permutations(singles, 2))
    specs += [PromptSpec(p) for p in pairs]
    specs += [PromptSpec(p, r) for r in RELATIONS for p in pairs]
    texts = [s.text for s in specs if kind is None or s.kind == kind]
    if split in ("dev", "test"):
        return tuple(t for t in _prompts(kind, "heldout") if _heldout_halves()[t] == split)
    if split is None:
        return tuple(texts)
    return tuple(t for t in texts if (t in _heldout()) == (split == "heldout"))


def sample_prompts(n: int, seed: int, split: str = "train", kinds: tuple[str, ...] = KINDS) -> list[str]:
    """n prompts of `split`, drawn with replacement: a kind uniformly from `kinds` (so the 528
    position prompts do not swamp the 12 single-object ones), then a prompt of that kind."""
    pools = {k: all_prompts(k, split) for k in kinds}  # every kind has prompts in every split
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pool = pools[kinds[rng.integers(len(kinds))]]
        out.append(pool[rng.integers(len(pool))])
    return out


def _place(spec: PromptSpec, size: int, rng: np.random.Generator) -> list[tuple[ObjectSpec, tuple[int, int, int, int]]]:
    from unirl.stages.toys.geneval.detector import relations  # at call time: detector imports this module while it loads

    gap = max(2, round(0.06 * size))
    lo, hi = max(5, round(0.22 * size)), max(6, round(0.32 * size))
    instances = [o for o in spec.objects for _ in range(o.count)]
    for _ in range(2000):
        boxes: list[tuple[int, int, int, int]] = []
        for _obj in instances:
            side = int(rng.integers(lo, hi + 1))
            x0, y0 = (int(v) for v in rng.integers(1, size - side, size=2))
            box = (x0, y0, x0 + side - 1, y0 + side - 1)
            if any(
                box[0] <= b[2] + gap and b[0] <= box[2] + gap and box[1] <= b[3] + gap and b[1] <= box[3] + gap
                for b in boxes
            ):
                break
            boxes.append(box)
        else:
            # A position scene must show its relation and no other, so the SFT data is unambiguous.
            if spec.relation is None or relations(boxes[0], boxes[1]) == {spec.relation}:
                return list(zip(instances, boxes))
    raise ValueError(f"could not lay out {spec.text!r} at {size}x{size}; use a larger image size")


def render(spec: PromptSpec | str, size: int = 32, seed: int = 0) -> Image.Image:
    """Draw the scene a prompt describes: RGB, size x size, white background, no anti-aliasing.
    The layout (object sizes and places) is a function of (prompt, size, seed)."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if size < MIN_IMAGE_SIZE:
        raise ValueError(f"toy-GenEval images need size >= {MIN_IMAGE_SIZE}, got {size}")
    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha256(spec.text.encode()).digest()[:4], "big")])
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj, (x0, y0, x1, y1) in _place(spec, size, rng):
        fill = COLOURS[obj.colour]
        if obj.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    return image


@dataclass(frozen=True)
class Example:
    prompt: str
    image: Image.Image


def miscoloured(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec:
    """The scene a careless captioner would have called `spec`: one of its object groups (drawn at
    random) in another colour (drawn at random among the others)."""
    k = int(rng.integers(len(spec.objects)))
    obj = spec.objects[k]
    colour = str(rng.choice([c for c in COLOURS if c != obj.colour]))
    objects = tuple(ObjectSpec(o.shape, colour, o.count) if j == k else o for j, o in enumerate(spec.objects))
    return PromptSpec(objects, spec.relation)


def make_examples(n: int, seed: int, split: str = "train", size: int = 32, kinds: tuple[str, ...] | None = None,
                  noise: float = 0.0) -> list[Example]:
    """n (prompt, rendered image) pairs for flow-matching SFT, of `kinds` (default: all); image i is
    rendered with seed (seed, i) so two examples of one prompt show different layouts. `noise`: the
    fraction of pairs whose image shows one object group in another colour than the prompt says
    (caption noise, as in web alt-text): a model warm-started on them draws that slip too."""
    prompts = sample_prompts(n, seed, split, kinds=kinds or KINDS)
    slips = np.random.default_rng([seed, 7919]).random(n) < noise
    out = []
    for i, p in enumerate(prompts):
        spec = parse_prompt(p)
        if slips[i]:
            spec = miscoloured(spec, np.random.default_rng([seed, i, 7919]))
        out.append(Example(p, render(spec, size, seed=seed * 1_000_003 + i)))
    return out

"""Toy-GenEval intents said in other words, for the prompt-enhancer demo: a user asks for "a red
circle" as "draw a crimson disc" or "show me one scarlet ring"; a rewriter must turn that back
into the canonical prompt the drawer was trained on.

Vocabulary (every word outside the canonical grammar is one the drawer never saw):

    colour    red: red, crimson, scarlet | green: green, emerald, lime | blue: blue, azure, navy |
              yellow: yellow, golden, lemon
    shape     circle: circle, disc, ring | square: square, box, tile | triangle: triangle, wedge, pyramid
              (plural with 's'; 'box' -> 'boxes')
    count     1: a, one, a single | 2: two, a pair of, 2 | 3: three, a trio of, 3
    frame     "{x}", "draw {x}", "show me {x}", "a picture of {x}", "i want {x}", "paint {x}"

Only single and count intents (one group of objects) are paraphrased: what a tiny drawer draws.
A paraphrase is a function of (intent, choice index): `paraphrases(intent)` enumerates them all in
a fixed order, and the held-out split is a fixed property of each paraphrase's text (a hash), so
held-out prompts are phrasings the rewriter never trained on, of intents the drawer knows.
"""
from __future__ import annotations

import functools
import hashlib
import itertools

from unirl.stages.toys.geneval.dataset import COLOURS, parse_prompt

COLOUR_WORDS = {"red": ("red", "crimson", "scarlet"), "green": ("green", "emerald", "lime"),
                "blue": ("blue", "azure", "navy"), "yellow": ("yellow", "golden", "lemon")}
SHAPE_WORDS = {"circle": ("circle", "disc", "ring"), "square": ("square", "box", "tile"),
               "triangle": ("triangle", "wedge", "pyramid")}
COUNT_WORDS = {1: ("a", "one", "a single"), 2: ("two", "a pair of", "2"), 3: ("three", "a trio of", "3")}
FRAMES = ("{x}", "draw {x}", "show me {x}", "a picture of {x}", "i want {x}", "paint {x}")
# The rewriter's character set: every character of a paraphrase or a canonical prompt.
PE_CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 "
HELDOUT_PERCENT = 20


def lexicon() -> tuple[str, ...]:
    """Every word a paraphrase is made of (a word-level tokenizer's vocabulary for them)."""
    words = [w for table in (COLOUR_WORDS, SHAPE_WORDS, COUNT_WORDS) for options in table.values() for o in options
             for w in o.split()]
    words += [plural(w) for options in SHAPE_WORDS.values() for w in options]
    words += [w for frame in FRAMES for w in frame.replace("{x}", "").split()]
    return tuple(dict.fromkeys(words))


def plural(noun: str) -> str:
    return noun + ("es" if noun.endswith("x") else "s")


@functools.cache
def paraphrases(intent: str) -> tuple[str, ...]:
    """Every paraphrase of a single- or count-kind canonical prompt, in a fixed order (the
    canonical text itself is not among them)."""
    spec = parse_prompt(intent)
    if len(spec.objects) != 1 or spec.relation is not None:
        raise ValueError(f"{intent!r}: only one group of objects (single and count prompts) is paraphrased")
    obj = spec.objects[0]
    out = []
    for count, colour, shape, frame in itertools.product(COUNT_WORDS[obj.count], COLOUR_WORDS[obj.colour],
                                                         SHAPE_WORDS[obj.shape], FRAMES):
        noun = shape if obj.count == 1 else plural(shape)
        text = frame.format(x=f"{count} {colour} {noun}")
        if text != intent:
            out.append(text)
    return tuple(out)


def split_of(text: str) -> str:
    """'heldout' for a fixed HELDOUT_PERCENT of paraphrases (by the hash of the text), else 'train'."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100
    return "heldout" if h < HELDOUT_PERCENT else "train"


def paraphrase_pool(intents: tuple[str, ...], split: str) -> list[tuple[str, str]]:
    """(paraphrase, intent) pairs of `split`, over `intents`, in a fixed order."""
    return [(p, intent) for intent in intents for p in paraphrases(intent) if split_of(p) == split]


def wrong_colour(intent: str) -> str:
    """The intent with its colour replaced by the next colour (COLOURS order): the slip of the
    imperfect rewriter teacher (`sft.noise`)."""
    spec = parse_prompt(intent)
    names = list(COLOURS)
    colour = spec.objects[0].colour
    return intent.replace(colour, names[(names.index(colour) + 1) % len(names)], 1)

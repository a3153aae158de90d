"""Toy GenEval: a procedural prompt/image dataset of coloured shapes (`dataset`) and a
deterministic detector that scores an image against its prompt (`detector`)."""
from unirl.stages.toys.geneval.dataset import (
    COLOURS,
    GRAMMAR,
    KINDS,
    RELATIONS,
    SHAPES,
    SPLITS,
    WORDS,
    Example,
    ObjectSpec,
    PromptSpec,
    all_prompts,
    make_examples,
    parse_prompt,
    render,
    sample_prompts,
    split_of,
)
from unirl.stages.toys.geneval.detector import Blob, GenEvalScore, detect, relations, score

__all__ = [
    "COLOURS", "GRAMMAR", "KINDS", "RELATIONS", "SHAPES", "SPLITS", "WORDS", "Blob", "Example",
    "GenEvalScore", "ObjectSpec", "PromptSpec", "all_prompts", "detect", "make_examples",
    "parse_prompt", "relations", "render", "sample_prompts", "score", "split_of",
]

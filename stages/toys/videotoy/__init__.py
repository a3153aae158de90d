"""A toy video task with a verifiable reward: procedural clips of coloured squares that move, the
prompt giving their count, colour, direction and speed ("two blue squares moving up quickly"), a
deterministic per-frame detector, and a score of how well a clip follows its prompt. Numpy and PIL
only, no model: the reward can be checked by hand, and the held-out split is a fixed property of
each prompt's text."""
from unirl.stages.toys.videotoy.dataset import (
                                     COLOURS,
                                     DIRECTIONS,
                                     SPEEDS,
                                     ClipSpec,
                                     all_prompts,
                                     make_clips,
                                     parse_prompt,
                                     render,
                                     sample_prompts,
                                     split_of,
)
from unirl.stages.toys.videotoy.detector import ClipScore, score

__all__ = ["COLOURS", "DIRECTIONS", "SPEEDS", "ClipScore", "ClipSpec", "all_prompts", "make_clips", "parse_prompt", "render",
           "sample_prompts", "score", "split_of"]

"""A graded toy-GenEval reward for RL: partial credit on the way to the strict score, and no
credit for clutter. The component mean (object, colour, count, position) can be won by scattering
blobs of every colour and shape (object and colour then hold for any prompt), and the strict score
alone is too sparse for a weak model to learn from. Per object group of the prompt (n objects of
one shape and colour, m blobs of that shape and colour found):

    group = 1                       if m == n
            0.5 * min(m, n) / m     if 0 < m != n   (right kind, wrong number: more blobs earn less)
            0.1 * (shape seen) + 0.1 * (colour seen)   if m == 0
    graded = mean over groups * (1 if the relation holds or there is none, else 0.5)

graded == 1 exactly when strict == 1; blobs of kinds the prompt does not name cost nothing, as in
GenEval. Evaluation still reports the strict score.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from stages.rewards.base import ScoreBatch, ScoreResult, register_scorer


def graded_score(image: Any, prompt: str) -> dict[str, float]:
    """`graded`, `strict` and the four GenEval components of one image."""
    from stages.geneval import detect, parse_prompt
    from stages.geneval.detector import score_blobs

    spec = parse_prompt(prompt)
    blobs = detect(image)
    s = score_blobs(blobs, spec).as_dict()
    groups = []
    for obj in spec.objects:
        m = sum(b.shape == obj.shape and b.colour == obj.colour for b in blobs)
        if m == obj.count:
            groups.append(1.0)
        elif m > 0:
            groups.append(0.5 * min(m, obj.count) / m)
        else:
            groups.append(0.1 * any(b.shape == obj.shape for b in blobs) + 0.1 * any(b.colour == obj.colour for b in blobs))
    graded = float(np.mean(groups)) * (1.0 if s["position"] == 1.0 else 0.5)
    return {"graded": graded, **s}


@register_scorer("geneval_graded")
class GradedGenEvalScorer:
    """Toy GenEval, graded (see the module docstring); components: strict, object, colour, count, position."""

    name = "geneval_graded"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.images is None:
            raise ValueError("scorer 'geneval_graded' scores images, but the batch has none (ScoreBatch.images is None)")
        results = [graded_score(image, prompt) for image, prompt in zip(batch.images, batch.prompts)]
        if not results:
            return ScoreResult(np.zeros(0))
        components = {k: np.array([r[k] for r in results], dtype=np.float64) for k in results[0] if k != "graded"}
        return ScoreResult(np.array([r["graded"] for r in results], dtype=np.float64), components)

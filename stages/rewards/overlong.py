"""What the reward does to responses that ran out of length (`reward.overlong.truncated`).

keep: rewards unchanged.
zero: a truncated response (finish_reason `length`) gets reward 0, whatever its scorers said.
soft: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:
      with L_max = max_new_tokens, L_cache = buffer and |y| the response length in tokens,
        R_length(y) = 0                              if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                             if |y| > L_max
      scaled by `penalty`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TRUNCATED_MODES = ("keep", "zero", "soft")


def soft_overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> np.ndarray:
    """R_length of DAPO eq. 13 for each response length; lengths (N,) -> (N,) float64 in [-1, 0]."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"reward.overlong.buffer: must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    y = np.asarray(lengths, dtype=np.float64)
    start = max_new_tokens - buffer  # L_max - L_cache
    ramp = (start - y) / buffer
    return np.where(y <= start, 0.0, np.where(y <= max_new_tokens, ramp, -1.0))


def apply_overlong(
    scores: np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    finish_reasons: Sequence[str],
    *,
    mode: str,
    max_new_tokens: int,
    buffer: int = 1,
    penalty: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply `mode` to the rewards. scores, response_lengths: (N,); finish_reasons: N strings.

    Returns (new_scores, component), both (N,) float64, with component = new_scores - scores:
    what overlong handling added to each sample (logged as `reward/overlong`).
    """
    if mode not in TRUNCATED_MODES:
        raise ValueError(f"reward.overlong.truncated: unknown mode {mode!r} (allowed: {', '.join(TRUNCATED_MODES)})")
    scores = np.asarray(scores, dtype=np.float64)
    lengths = np.asarray(response_lengths, dtype=np.float64)
    if lengths.shape != scores.shape or len(finish_reasons) != len(scores):
        raise ValueError(
            f"apply_overlong: {len(scores)} scores, {lengths.size} lengths and {len(finish_reasons)} finish reasons"
        )
    if lengths.size and lengths.min() < 0:
        raise ValueError("apply_overlong: response lengths must be >= 0")
    if mode == "keep":
        new = scores.copy()
    elif mode == "zero":
        truncated = np.array([r == "length" for r in finish_reasons], dtype=bool)
        new = np.where(truncated, 0.0, scores)
    else:
        new = scores + penalty * soft_overlong_penalty(lengths, max_new_tokens, buffer)
    return new, new - scores

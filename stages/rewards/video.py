"""`video`: score a video with an image scorer, frame by frame, and average.

Each sample's frames (at most `max_frames`, evenly spaced, first and last included) become one
image-batch row each (same prompt, text and metadata; sample id `<id>#frame<k>`), scored by the
inner scorer in one call. Normalization: score = mean over the used frames of the inner score,
so it keeps the inner scorer's range; each inner component is averaged the same way.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, build_scorer, register_scorer, run_scorer


def frame_indices(n: int, max_frames: int | None) -> list[int]:
    """Indices of the frames to score: all of them, or max_frames evenly spaced over [0, n-1]."""
    if max_frames is None or n <= max_frames:
        return list(range(n))
    if max_frames == 1:
        return [0]
    return sorted({round(i * (n - 1) / (max_frames - 1)) for i in range(max_frames)})


@register_scorer("video", reads=("video",))
class VideoScore:
    """Needs batch.videos (N lists of PIL frames). Params: scorer (inner scorer name),
    params (its keyword args), max_frames (None = every frame)."""

    name = "video"

    def __init__(self, scorer: str, params: dict[str, Any] | None = None, max_frames: int | None = None) -> None:
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"scorer 'video': max_frames must be >= 1, got {max_frames}")
        self.inner = build_scorer(scorer, **(params or {}))
        self.max_frames = max_frames

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.videos is None:
            raise ValueError("scorer 'video' needs videos (ScoreBatch.videos) and the batch has none")
        owner: list[int] = []
        frames: list[Any] = []
        frame_ids: list[str] = []
        for i, (sid, video) in enumerate(zip(batch.sample_ids, batch.videos)):
            if not video:
                raise ValueError(f"scorer 'video': sample {sid!r} has no frames")
            for k in frame_indices(len(video), self.max_frames):
                owner.append(i)
                frames.append(video[k])
                frame_ids.append(f"{sid}#frame{k}")
        texts = [batch.texts[i] for i in owner] if batch.texts is not None else None
        per_frame = ScoreBatch(
            sample_ids=frame_ids,
            prompts=[batch.prompts[i] for i in owner],
            texts=texts,
            images=frames,
            metadata=[batch.metadata[i] for i in owner],
        )
        result = run_scorer(self.inner, per_frame)
        counts = np.bincount(owner, minlength=len(batch)).astype(np.float64)

        def mean(values: np.ndarray) -> np.ndarray:
            return np.bincount(owner, weights=values, minlength=len(batch)) / counts

        return ScoreResult(mean(result.scores), {k: mean(v) for k, v in result.components.items()})

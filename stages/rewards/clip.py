"""`clip`: CLIP score of an image against its prompt (Hessel et al. 2021, "CLIPScore").

Normalization: score = w * max(cos(E_image, E_prompt), 0), in [0, w]; w = 1 by default
(w = 2.5 reproduces the paper's CLIP-S numbers). Embeddings are L2-normalized CLIP projections.
"""
from __future__ import annotations

import numpy as np

from unirl.stages.rewards._hf import need_images
from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer


@register_scorer("clip", reads=("image",))
class ClipScore:
    """Needs batch.images (N PIL) and batch.prompts. Params: model_path (local CLIPModel dir),
    w, processor_path, device, dtype, batch_size (see _clip.ClipEmbedder)."""

    name = "clip"

    def __init__(self, model_path: str, *, w: float = 1.0,
                 processor_path: str | None = None, device: str = "auto", dtype: str = "float32", batch_size: int = 32) -> None:
        # start-up time: it loads torch
        from unirl.stages.rewards._clip import ClipEmbedder  # torch + transformers only when built

        self.w = float(w)
        self.embedder = ClipEmbedder(model_path, scorer=self.name, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size)

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        cos = self.embedder.cosine(need_images(batch, self.name), batch.prompts)
        return ScoreResult(self.w * np.maximum(cos, 0.0))

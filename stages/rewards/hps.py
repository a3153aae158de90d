"""`hps`: Human Preference Score (Wu et al. 2023, HPS v1 / HPS v2) from a preference-tuned CLIP.

Normalization: score = scale * cos(E_image, E_prompt), in [-scale, scale]. scale = 1 by default,
the HPS v2 convention (typical values 0.2-0.35); HPS v1 reports 100 * cos (scale: 100).
The weights must be in transformers CLIPModel layout (convert an open_clip HPS checkpoint first).
"""
from __future__ import annotations

from unirl.stages.rewards._hf import need_images
from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer


@register_scorer("hps", reads=("image",))
class HumanPreferenceScore:
    """Needs batch.images and batch.prompts. Params: model_path, scale, processor_path, device,
    dtype, batch_size."""

    name = "hps"

    def __init__(self, model_path: str, *, scale: float = 1.0,
                 processor_path: str | None = None, device: str = "auto", dtype: str = "float32", batch_size: int = 32) -> None:
        from unirl.stages.rewards._clip import ClipEmbedder  # start-up time: it loads torch

        self.scale = float(scale)
        self.embedder = ClipEmbedder(model_path, scorer=self.name, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size)

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        cos = self.embedder.cosine(need_images(batch, self.name), batch.prompts)
        return ScoreResult(self.scale * cos)

"""`pickscore`: PickScore-style preference (Kirstain et al. 2023, "Pick-a-Pic").

A CLIP model fine-tuned on human preferences scores image i against its prompt as
    score = exp(logit_scale) * cos(E_image, E_prompt) / divisor,
in [-exp(logit_scale), exp(logit_scale)] / divisor; exp(logit_scale) is the model's own learned
scale (about 100 for PickScore_v1, so raw scores sit near 20-23). divisor = 1 by default;
Flow-GRPO divides by 26 to bring PickScore_v1 to about [0, 1].
PickScore_v1 ships without a processor: point processor_path at the CLIP-ViT-H-14 processor.
"""
from __future__ import annotations

from unirl.stages.rewards._hf import need_images
from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer


@register_scorer("pickscore", reads=("image",))
class PickScore:
    """Needs batch.images and batch.prompts. Params: model_path, divisor, processor_path, device,
    dtype, batch_size."""

    name = "pickscore"

    def __init__(self, model_path: str, *, divisor: float = 1.0,
                 processor_path: str | None = None, device: str = "auto", dtype: str = "float32", batch_size: int = 32) -> None:
        from unirl.stages.rewards._clip import ClipEmbedder  # start-up time: it loads torch

        if divisor <= 0:
            raise ValueError(f"scorer 'pickscore': divisor must be positive, got {divisor}")
        self.divisor = float(divisor)
        self.embedder = ClipEmbedder(model_path, scorer=self.name, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size)
        self.scale = self.embedder.logit_scale  # fixed after loading

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        cos = self.embedder.cosine(need_images(batch, self.name), batch.prompts)
        return ScoreResult(self.scale * cos / self.divisor)

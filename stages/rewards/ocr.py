"""`ocr`: does the image show the text the prompt asks for? (text-rendering reward, as in Flow-GRPO)

A transformers VisionEncoderDecoderModel (e.g. TrOCR) reads each image greedily; the target is
the text inside the prompt's double quotes ("..." or “...”; several quoted spans are joined
with a space), or `metadata["ocr_text"]` when given. Both strings are normalized (case-folded
unless ignore_case is false; whitespace removed when ignore_spaces, else collapsed), then

    score = 1 - lev(read, target) / max(len(read), len(target))      in [0, 1]

(lev = Levenshtein edit distance; 1 when both are empty). A prompt with no quoted text is an
error naming the sample.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from unirl.stages.rewards._hf import local_dir, micro_batches, need_images, pick_device, pick_dtype
from unirl.stages.rewards.base import ScoreBatch, ScorerError, ScoreResult, register_scorer

_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def quoted_text(prompt: str) -> str | None:
    """The text inside the prompt's double quotes, spans joined by a space; None if there is none."""
    spans = [a or b for a, b in _QUOTED.findall(prompt)]
    return " ".join(spans) if spans else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_similarity(read: str, target: str, *, ignore_case: bool = True, ignore_spaces: bool = True) -> float:
    """1 - normalized edit distance of the normalized strings, in [0, 1]."""

    def norm(s: str) -> str:
        s = s.casefold() if ignore_case else s
        return re.sub(r"\s+", "", s) if ignore_spaces else " ".join(s.split())

    a, b = norm(read), norm(target)
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - edit_distance(a, b) / longest


@register_scorer("ocr", reads=("image",))
class OcrScore:
    """Needs batch.images and quoted text in batch.prompts. Params: model_path (directory with the
    VisionEncoderDecoderModel, its tokenizer and image processor), max_new_tokens, ignore_case,
    ignore_spaces, device, dtype, batch_size. Component `exact`: 1 where the text matches exactly
    after normalization."""

    name = "ocr"

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int = 64,
        ignore_case: bool = True,
        ignore_spaces: bool = True,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        # start-up time: transformers loads on first use, not when a recipe is read
        from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

        path = local_dir(model_path, self.name)
        self.device, self.batch_size, self.max_new_tokens = pick_device(device), batch_size, max_new_tokens
        self.ignore_case, self.ignore_spaces = ignore_case, ignore_spaces
        self.model = VisionEncoderDecoderModel.from_pretrained(path, dtype=pick_dtype(dtype), local_files_only=True)
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)

    def read(self, images: list[Any]) -> list[str]:
        """Greedy transcription of each image: N PIL images -> N strings."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        texts: list[str] = []
        for sl in micro_batches(len(images), self.batch_size):
            pixels = self.image_processor(images=images[sl], return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                ids = self.model.generate(pixel_values=pixels.to(self.device, self.model.dtype),
                                          max_new_tokens=self.max_new_tokens, do_sample=False)
            texts += self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return texts

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        images = need_images(batch, self.name)
        targets = []
        for sid, prompt, meta in zip(batch.sample_ids, batch.prompts, batch.metadata):
            target = meta.get("ocr_text") or quoted_text(prompt)
            if target is None:
                raise ScorerError(f"scorer 'ocr': sample {sid!r} has no quoted text in its prompt "
                                  f"{prompt[:200]!r} and no metadata['ocr_text'] to compare against")
            targets.append(target)
        reads = self.read(images)
        scores = np.array([text_similarity(r, t, ignore_case=self.ignore_case, ignore_spaces=self.ignore_spaces)
                           for r, t in zip(reads, targets)])
        return ScoreResult(scores, {"exact": (scores == 1.0).astype(np.float64)})

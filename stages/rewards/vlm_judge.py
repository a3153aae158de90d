"""`vlm_judge`: a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: whatever its folder's config
names) rates each sample; the score is parsed from its answer.

The model sees the sample's image (when the batch has images: a generated image, or the image a
vision-language policy's prompt showed) and the scoring question, formatted
with {prompt}, {text} (the decoded response, "" when absent), {min_score} and {max_score}, in
Qwen's ChatML turn format. It answers greedily; the first number in the answer is s, and

    score = (s - min_score) / (max_score - min_score)      in [0, 1].

An answer with no number, or a number outside [min_score, max_score], is an error for that sample:
the ScorerError names the sample and quotes the answer (never a silent zero).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from unirl.stages.rewards._hf import local_dir, micro_batches, pick_device, pick_dtype
from unirl.stages.rewards.base import ScoreBatch, ScorerError, ScoreResult, register_scorer

DEFAULT_QUESTION = (
    "Rate how well the image matches the prompt and how good it looks, on a scale from "
    "{min_score:g} to {max_score:g}. Answer with the number only.\nPrompt: {prompt}"
)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(answer: str, min_score: float, max_score: float) -> float | None:
    """The first number in `answer` mapped to [0, 1]; None if there is none or it is out of range."""
    match = _NUMBER.search(answer)
    if match is None:
        return None
    value = float(match.group())
    if not min_score <= value <= max_score:
        return None
    return (value - min_score) / (max_score - min_score)


@register_scorer("vlm_judge", reads=("image",))
class VlmJudge:
    """Params: model_path (a Qwen-VL *ForConditionalGeneration + tokenizer + image processor), question,
    system (optional system turn), min_score, max_score, max_new_tokens, device, dtype, batch_size."""

    name = "vlm_judge"

    def __init__(
        self,
        model_path: str,
        *,
        question: str = DEFAULT_QUESTION,
        system: str | None = None,
        min_score: float = 0.0,
        max_score: float = 10.0,
        max_new_tokens: int = 8,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 8,
    ) -> None:
        # start-up time: transformers loads on first use, not when a recipe is read
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        if not max_score > min_score:
            raise ValueError(f"scorer 'vlm_judge': max_score ({max_score}) must exceed min_score ({min_score})")
        path = local_dir(model_path, self.name)
        self.question, self.system = question, system
        self.min_score, self.max_score = float(min_score), float(max_score)
        self.max_new_tokens, self.batch_size, self.device = max_new_tokens, batch_size, pick_device(device)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=pick_dtype(dtype), local_files_only=True)
        self.model.to(self.device).eval()
        # The processor class is not used because it also needs a video processor (torchvision);
        # the one thing it adds, expanding <|image_pad|> to the image's token count, is done here.
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)

    def _chat(self, question: str, n_image_tokens: int) -> str:
        image = f"<|vision_start|>{'<|image_pad|>' * n_image_tokens}<|vision_end|>" if n_image_tokens else ""
        system = f"<|im_start|>system\n{self.system}<|im_end|>\n" if self.system else ""
        return f"{system}<|im_start|>user\n{image}{question}<|im_end|>\n<|im_start|>assistant\n"

    def answers(self, batch: ScoreBatch) -> list[str]:
        """The model's raw answer for each sample (N strings)."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        out: list[str] = []
        for sl in micro_batches(len(batch), self.batch_size):
            questions = [
                self.question.format(prompt=p, text=t, min_score=self.min_score, max_score=self.max_score)
                for p, t in zip(batch.prompts[sl], (batch.texts or [""] * len(batch))[sl])
            ]
            vision: dict[str, Any] = {}
            n_tokens = [0] * len(questions)
            if batch.images is not None:
                vision = dict(self.image_processor(images=batch.images[sl], return_tensors="pt"))
                merge = self.image_processor.merge_size ** 2
                n_tokens = (vision["image_grid_thw"].prod(-1) // merge).tolist()
                vision["pixel_values"] = vision["pixel_values"].to(self.model.dtype)
            enc = self.tokenizer([self._chat(q, n) for q, n in zip(questions, n_tokens)],
                                 padding=True, return_tensors="pt")
            # The image tokens' 3-D (M-RoPE) positions are computed from these; without them a
            # Qwen-VL model reads the image with 1-D text positions (or refuses it).
            mm = (enc["input_ids"] == self.model.config.image_token_id).int()
            inputs = {**enc, **vision, "mm_token_type_ids": mm}
            with torch.inference_mode():
                ids = self.model.generate(**{k: v.to(self.device) for k, v in inputs.items()},
                                          max_new_tokens=self.max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
            out += self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return out

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        scores = []
        for sid, answer in zip(batch.sample_ids, self.answers(batch)):
            score = parse_score(answer, self.min_score, self.max_score)
            if score is None:
                raise ScorerError(
                    f"scorer 'vlm_judge': no score in [{self.min_score:g}, {self.max_score:g}] "
                    f"in the answer for sample {sid!r}: {answer[:200]!r}"
                )
            scores.append(score)
        return ScoreResult(np.array(scores, dtype=np.float64))

"""CLIP embeddings for the clip / pickscore / hps / aesthetic scorers.

Loads `transformers.CLIPModel` plus its tokenizer and image processor from local directories
(the processor may live in its own directory: PickScore ships the model without one).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

from unirl.stages.rewards._hf import local_dir, micro_batches, pick_device, pick_dtype


class ClipEmbedder:
    """Unit-norm CLIP embeddings. Holds the model in eval mode on `device`; thread-safe to call.

    Args:
        model_path: directory with a CLIPModel (config.json + weights).
        processor_path: directory with the tokenizer and image processor; default model_path.
        device: 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...; dtype: float32 | float16 | bfloat16.
        batch_size: images or texts per forward pass.
    """

    def __init__(
        self,
        model_path: str,
        *,
        scorer: str,
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        model_dir = local_dir(model_path, scorer)
        proc_dir = local_dir(processor_path, scorer, "processor_path") if processor_path else model_dir
        self.device, self.batch_size = pick_device(device), batch_size
        self.model = CLIPModel.from_pretrained(model_dir, dtype=pick_dtype(dtype), local_files_only=True)
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(proc_dir, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(proc_dir, local_files_only=True)
        # Prompts longer than the text tower's positions are truncated, as CLIP was trained.
        self.max_text_len = min(
            self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings
        )

    @property
    def logit_scale(self) -> float:
        """exp(model.logit_scale): the learned inverse temperature (100 for OpenAI CLIP)."""
        return float(self.model.logit_scale.detach().float().exp())

    @torch.inference_mode()
    def image_embeds(self, images: list[Any]) -> np.ndarray:
        """images: N PIL images -> (N, D) float64, each row L2-normalized."""
        out = []
        for sl in micro_batches(len(images), self.batch_size):
            pixels = self.image_processor(images=images[sl], return_tensors="pt")["pixel_values"]
            feats = self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype))
            out.append(_unit(feats.pooler_output))
        return np.concatenate(out)

    @torch.inference_mode()
    def text_embeds(self, texts: list[str]) -> np.ndarray:
        """texts: N strings -> (N, D) float64, each row L2-normalized."""
        out = []
        for sl in micro_batches(len(texts), self.batch_size):
            enc = self.tokenizer(texts[sl], padding=True, truncation=True,
                                 max_length=self.max_text_len, return_tensors="pt").to(self.device)
            feats = self.model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            out.append(_unit(feats.pooler_output))
        return np.concatenate(out)

    def cosine(self, images: list[Any], texts: list[str]) -> np.ndarray:
        """(N,) cosine similarity of image i with text i, in [-1, 1]."""
        cos = np.einsum("nd,nd->n", self.image_embeds(images), self.text_embeds(texts))
        return np.clip(cos, -1.0, 1.0)  # rounding can push |cos| a hair past 1


def _unit(x: torch.Tensor) -> np.ndarray:
    x = x.float()
    return (x / x.norm(dim=-1, keepdim=True)).cpu().numpy().astype(np.float64)

"""`aesthetic`: an aesthetic predictor (LAION "improved aesthetic predictor" style): an MLP head
on the CLIP image embedding.

Normalization: the image embedding is L2-normalized, then the head's raw output is the score
(no further scaling: the LAION v2 head gives roughly 1-10). The prompt is not used.

The head lives in a safetensors file (default `aesthetic_head.safetensors` in model_path): a chain
of linear layers `<name>.weight` (out, in) and `<name>.bias` (out), applied in the natural order of
their names (`layers.0`, `layers.2`, ..., `layers.10`), the last with out = 1. LAION's v2 head has no
activation between layers (its dropouts are identity at inference); `activation` adds one.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from unirl.stages.rewards._hf import local_dir, need_images
from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer

_ACTIVATIONS = {
    "none": lambda x: x,
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))),
}


def load_linear_chain(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read (weight (out, in), bias (out,)) pairs in float64, checking the dimensions chain."""
    from safetensors.torch import load_file  # start-up time: safetensors loads on first use, not when a recipe is read

    tensors = load_file(str(path))
    names = sorted({k.rsplit(".", 1)[0] for k in tensors},
                   key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])
    layers: list[tuple[np.ndarray, np.ndarray]] = []
    for name in names:
        if f"{name}.weight" not in tensors or tensors[f"{name}.weight"].ndim != 2:
            raise ValueError(f"{path}: {name!r} has no 2-D '{name}.weight'; expected linear layers only")
        weight = tensors[f"{name}.weight"].double().numpy()
        stored = tensors.get(f"{name}.bias")
        bias = stored.double().numpy() if stored is not None else np.zeros(weight.shape[0])
        if layers and layers[-1][0].shape[0] != weight.shape[1]:
            raise ValueError(f"{path}: {name!r} takes {weight.shape[1]} inputs but the layer before gives "
                             f"{layers[-1][0].shape[0]}")
        layers.append((weight, bias))
    if not layers or layers[-1][0].shape[0] != 1:
        raise ValueError(f"{path}: the last linear layer must have one output")
    return layers


@register_scorer("aesthetic", reads=("image",))
class AestheticScore:
    """Needs batch.images. Params: model_path (CLIPModel dir), head_file (relative to model_path,
    or absolute), activation (none | relu | gelu), processor_path, device, dtype, batch_size."""

    name = "aesthetic"

    def __init__(
        self,
        model_path: str,
        *,
        head_file: str = "aesthetic_head.safetensors",
        activation: str = "none",
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        from unirl.stages.rewards._clip import ClipEmbedder  # start-up time: it loads torch

        if activation not in _ACTIVATIONS:
            raise ValueError(f"scorer 'aesthetic': activation must be one of {sorted(_ACTIVATIONS)}")
        head = Path(local_dir(model_path, self.name), head_file)
        if not head.is_file():
            raise FileNotFoundError(f"scorer 'aesthetic': head file {str(head)!r} not found")
        self.layers = load_linear_chain(head)
        self.activation = _ACTIVATIONS[activation]
        self.embedder = ClipEmbedder(model_path, scorer=self.name, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size)
        dim = self.embedder.model.config.projection_dim
        if self.layers[0][0].shape[1] != dim:
            raise ValueError(f"scorer 'aesthetic': {head} expects {self.layers[0][0].shape[1]}-d "
                             f"embeddings but the CLIP model gives {dim}-d")

    def head(self, embeds: np.ndarray) -> np.ndarray:
        """embeds: (N, D) unit-norm -> (N,) scores."""
        x = embeds
        for i, (weight, bias) in enumerate(self.layers):
            x = x @ weight.T + bias
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x[:, 0]

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        return ScoreResult(self.head(self.embedder.image_embeds(need_images(batch, self.name))))

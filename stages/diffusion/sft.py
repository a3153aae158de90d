"""Supervised warm start of an image model on (prompt, image) records: first the VAE learns to
reconstruct the images (a tiny model's VAE is random, so decode(encode(x)) would be noise and
every GenEval score 0), then the transformer learns the flow-matching objective on the latents.

Flow matching (rectified flow, SD3): x_sigma = (1 - sigma) * x0 + sigma * noise, target velocity
v = noise - x0, loss = mean (v_theta(x_sigma, sigma) - v)^2, sigma ~ logit-normal(0, 1)
(Esser et al. 2024, eq. 9 with the "lognorm" sampling of section 3.1).
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from torch import Tensor

from unirl.stages.diffusion.sampling import Velocity
from unirl.stages.diffusion.sde import shift_sigmas
from unirl.stages.models.flow_vae import reconstruction_loss, standardize_latents, to_pixels, warm_up_vae  # noqa: F401 (re-exported)
from unirl.stages.runtime.seeds import batch_indices, derive_seed  # noqa: F401 (re-exported)
from unirl.stages.toys.geneval import make_examples

# ---------------------------------------------------------------- records


def geneval_records(n: int, *, seed: int, image_size: int, kinds: tuple[str, ...] | None = None,
                    noise: float = 0.0) -> list[dict[str, Any]]:
    """`n` toy-GenEval training records {prompt, media_png}: prompts of the train split (never
    the held-out one) of `kinds` (default: all), each rendered with its own layout; `noise` of
    them show one object group in a colour the prompt does not say (make_examples)."""
    out = []
    for ex in make_examples(n, seed, split="train", size=image_size, kinds=kinds, noise=noise):
        buf = io.BytesIO()
        ex.image.save(buf, format="PNG")
        out.append({"prompt": ex.prompt, "media_png": buf.getvalue()})
    return out


def decode_images(pngs: list[bytes], where: str = "") -> np.ndarray:
    """PNG bytes -> uint8 (N, H, W, 3); every image must have the same size."""
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in pngs]
    sizes = sorted({im.shape for im in images})
    if len(sizes) > 1:
        raise ValueError(f"{where}: SFT images must share one size, found {[s[:2] for s in sizes]}")
    return np.stack(images)


def decode_videos(clips: list[list[bytes]], where: str = "") -> np.ndarray:
    """Per clip a list of PNG frames -> uint8 (N, F, H, W, 3); every clip must have the same shape."""
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    videos = [np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in frames]) for frames in clips]
    shapes = sorted({v.shape for v in videos})
    if len(shapes) > 1:
        raise ValueError(f"{where}: SFT clips must share one shape (frames, height, width), found {[s[:3] for s in shapes]}")
    return np.stack(videos)


# ---------------------------------------------------------------- flow matching


def logit_normal_sigmas(sample_ids: list[Any], *, seed: int, step: int, shift: float = 1.0) -> Tensor:
    """(B,) sigma = shift_sigmas(sigmoid(n), shift), n ~ N(0, 1), one generator per (seed, step,
    record): shift > 1 moves training towards high noise as a shifted sampler's schedule is."""
    out = [torch.randn(1, generator=torch.Generator().manual_seed(derive_seed(seed, "sft-sigma", step, i, k)))
           for k, i in enumerate(sample_ids)]
    return shift_sigmas(torch.sigmoid(torch.cat(out)), shift)


def flow_matching_loss(velocity: Velocity, x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """mean over the batch and elements of (v_theta(x_sigma, sigma) - (noise - x0))^2.
    x0, noise: (B, C, h, w); sigma: (B,)."""
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    x_sigma = (1 - s) * x0 + s * noise
    return (velocity(x_sigma, sigma) - (noise - x0)).square().mean()

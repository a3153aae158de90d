"""Supervised warm start of an image model on (prompt, image) records: first the VAE learns to
reconstruct the images (a tiny model's VAE is random, so decode(encode(x)) would be noise and
every GenEval score 0), then the transformer learns the flow-matching objective on the latents.

Flow matching (rectified flow, SD3): x_sigma = (1 - sigma) * x0 + sigma * noise, target velocity
v = noise - x0, loss = mean (v_theta(x_sigma, sigma) - v)^2, sigma ~ logit-normal(0, 1)
(Esser et al. 2024, eq. 9 with the "lognorm" sampling of section 3.1).
"""
from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from unirl.stages.diffusion.sampling import Velocity
from unirl.stages.diffusion.sde import shift_sigmas
from unirl.stages.runtime.seeds import derive_seed

# ---------------------------------------------------------------- records


def geneval_records(n: int, *, seed: int, image_size: int, kinds: tuple[str, ...] | None = None,
                    noise: float = 0.0) -> list[dict[str, Any]]:
    """`n` toy-GenEval training records {prompt, media_png}: prompts of the train split (never
    the held-out one) of `kinds` (default: all), each rendered with its own layout; `noise` of
    them show one object group in a colour the prompt does not say (make_examples)."""
    from unirl.stages.toys.geneval import make_examples

    out = []
    for ex in make_examples(n, seed, split="train", size=image_size, kinds=kinds, noise=noise):
        buf = io.BytesIO()
        ex.image.save(buf, format="PNG")
        out.append({"prompt": ex.prompt, "media_png": buf.getvalue()})
    return out


def decode_images(pngs: list[bytes], where: str = "") -> np.ndarray:
    """PNG bytes -> uint8 (N, H, W, 3); every image must have the same size."""
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in pngs]
    sizes = sorted({im.shape for im in images})
    if len(sizes) > 1:
        raise ValueError(f"{where}: SFT images must share one size, found {[s[:2] for s in sizes]}")
    return np.stack(images)


def decode_videos(clips: list[list[bytes]], where: str = "") -> np.ndarray:
    """Per clip a list of PNG frames -> uint8 (N, F, H, W, 3); every clip must have the same shape."""
    from PIL import Image

    videos = [np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in frames]) for frames in clips]
    shapes = sorted({v.shape for v in videos})
    if len(shapes) > 1:
        raise ValueError(f"{where}: SFT clips must share one shape (frames, height, width), found {[s[:3] for s in shapes]}")
    return np.stack(videos)


def batch_indices(step: int, *, seed: int, batch_size: int, num_records: int) -> list[int]:
    """The records of SFT step `step`: a function of (seed, step) only, so chunks of steps give
    what one long call gives."""
    g = torch.Generator().manual_seed(derive_seed(seed, "sft-batch", step))
    return torch.randint(0, num_records, (batch_size,), generator=g).tolist()


# ---------------------------------------------------------------- VAE warm-up


def to_pixels(images: np.ndarray | Tensor) -> Tensor:
    """uint8 (B, H, W, 3) -> float32 (B, 3, H, W) in [-1, 1] (the VAE's input range); videos
    (B, F, H, W, 3) -> (B, 3, F, H, W)."""
    x = torch.as_tensor(np.asarray(images))
    x = (x.permute(0, 3, 1, 2) if x.ndim == 4 else x.permute(0, 4, 1, 2, 3)).float()
    return x / 127.5 - 1


def reconstruction_loss(vae: Any, pixels: Tensor, kl_weight: float = 1e-6, codec: Any = None) -> Tensor:
    """L1 + L2 of decode(mean of encode(x)) against x, plus a small KL to keep latents bounded.
    `codec` (unirl.stages.models.flow_vae): how its VAE reconstructs for training (default: decode)."""
    if codec is not None:
        rec, posterior = codec.reconstruction(vae, pixels)
    else:
        posterior = vae.encode(pixels).latent_dist
        rec = vae.decode(posterior.mean).sample
    err = rec - pixels
    return err.abs().mean() + err.square().mean() + kl_weight * posterior.kl().mean()


def warm_up_vae(
    vae: Any, images: np.ndarray, *, steps: int, lr: float, batch_size: int, seed: int,
    all_reduce: Callable[[list[Tensor]], None] | None = None, rank: int = 0, world: int = 1,
    log: Callable[[int, float], None] | None = None, codec: Any = None,
) -> dict[str, float]:
    """Train `vae` to reconstruct `images` (uint8 (N, H, W, 3), or clips (N, F, H, W, 3)): Adam with a
    20-step warm-up and cosine decay. `codec` (unirl.stages.models.flow_vae): uint8 media -> the VAE's
    input and its training reconstruction (default: `to_pixels`, decode). With several ranks each takes its share of every batch and `all_reduce`
    averages the gradients (a sum over ranks, divided here). Returns the final loss and time."""
    import time

    start = time.perf_counter()
    vae.requires_grad_(True).train()
    params = [p for p in vae.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    warm = min(20, max(1, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
    )
    pixels = (codec.pixels if codec is not None else to_pixels)(torch.as_tensor(np.asarray(images)))
    device = next(vae.parameters()).device
    loss_value = float("nan")
    for step in range(steps):
        idx = batch_indices(step, seed=derive_seed(seed, "vae"), batch_size=batch_size, num_records=len(pixels))
        mine = idx[rank::world]
        loss = reconstruction_loss(vae, pixels[mine].to(device), codec=codec)
        opt.zero_grad(set_to_none=False)
        (loss * len(mine) / len(idx)).backward()
        if all_reduce is not None and world > 1:
            all_reduce([p.grad for p in params])
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if log is not None:
            log(step, loss_value)
    vae.requires_grad_(False).eval()
    return {"vae_loss": loss_value, "vae_seconds": time.perf_counter() - start}


@torch.no_grad()
def standardize_latents(vae: Any, images: np.ndarray, batch: int = 256) -> dict[str, float]:
    """Set the VAE's `shift_factor` and `scaling_factor` so the normalized latents
    (z - shift) * scale of `images` have mean 0 and std 1 (what flow matching from N(0, 1) noise
    assumes; SD3's constants fit only SD3's own VAE)."""
    device = next(vae.parameters()).device
    from unirl.stages.models.flow_vae import ShiftScale

    zs = [vae.encode(to_pixels(images[i:i + batch]).to(device)).latent_dist.mean.float().cpu()
          for i in range(0, len(images), batch)]
    return ShiftScale().fit(vae, torch.cat(zs))


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

"""A flow family's VAE seen from the flow policy: uint8 media <-> the normalized latents it samples.

    encode: media (B, H, W, 3) or (B, F, H, W, 3) uint8 -> pixels in [-1, 1] -> z (posterior mean or a
            sample) -> x = normalize(z)   (the latents flow matching starts from N(0, 1) noise towards)
    decode: x -> z = denormalize(x) -> pixels, clamped to [-1, 1] -> uint8 media

Each VAE family normalizes its latents its own way, kept in its config or buffers so a saved folder
carries it: SD3 (z - shift_factor) * scaling_factor; HunyuanVideo z * scaling_factor; Wan and
Qwen-Image (z - latents_mean[c]) / latents_std[c] per channel; FLUX.2 a 2x2 patchify, then the VAE's
BatchNorm running statistics. `fit` sets those numbers from a set of latents so the normalized
latents have mean 0 and std 1 (a tiny model's VAE is trained from random in SFT, and the constants a
real checkpoint ships fit only its own weights).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from unirl.stages.kernels import no_grad
from unirl.stages.runtime.seeds import batch_indices, derive_seed

if TYPE_CHECKING:
    from torch import Tensor


def as_uint8_media(media: Any, video: bool) -> Tensor:
    """uint8 (B, H, W, 3) images or (B, F, H, W, 3) videos (array, tensor, or a list of PIL images /
    of frame lists) as a tensor; ValueError naming the expected layout otherwise."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    if isinstance(media, (list, tuple)):
        def frame(im: Any) -> np.ndarray:
            return np.asarray(im.convert("RGB") if hasattr(im, "convert") else im)

        media = np.stack([np.stack([frame(f) for f in m]) if video else frame(m) for m in media])
    media = torch.as_tensor(np.asarray(media))
    ndim = 5 if video else 4
    if media.ndim != ndim or media.shape[-1] != 3 or media.dtype != torch.uint8:
        layout = "videos (B, F, H, W, 3)" if video else "images (B, H, W, 3)"
        raise ValueError(f"expected uint8 {layout}, got {media.dtype} {tuple(media.shape)}")
    return media


class LatentCodec:
    """Media <-> normalized latents through one kind of VAE. `video_vae`: the VAE takes
    (B, 3, F, H, W) (images go through it as one frame); else (B, 3, H, W)."""

    video_vae = False

    def normalize(self, vae: Any, z: Tensor) -> Tensor:
        raise NotImplementedError

    def denormalize(self, vae: Any, x: Tensor) -> Tensor:
        raise NotImplementedError

    def fit(self, vae: Any, z: Tensor) -> dict[str, float]:
        """Set the normalization so normalize(z) has mean 0 and std 1; returns what it set."""
        raise NotImplementedError

    # -- pixels ---------------------------------------------------------------------------------
    def pixels(self, media: Tensor) -> Tensor:
        """uint8 (B, H, W, 3) / (B, F, H, W, 3) -> float32 VAE input in [-1, 1]."""
        x = media.float() / 127.5 - 1
        if media.ndim == 4:
            x = x.permute(0, 3, 1, 2)
            return x.unsqueeze(2) if self.video_vae else x
        return x.permute(0, 4, 1, 2, 3)

    def media(self, pixels: Tensor, video: bool) -> Tensor:
        """VAE output in [-1, 1] -> uint8 media on the CPU, images (B, H, W, 3) or videos (B, F, H, W, 3)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        out = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        if out.ndim == 4:
            return out.permute(0, 2, 3, 1).cpu()
        if not video:
            return out[:, :, 0].permute(0, 2, 3, 1).cpu()
        return out.permute(0, 2, 3, 4, 1).cpu()

    def reconstruction(self, vae: Any, pixels: Tensor) -> tuple[Tensor, Any]:
        """(decode of the posterior mean, the posterior) with gradients, for training the VAE."""
        posterior = vae.encode(pixels).latent_dist
        return vae.decode(posterior.mean).sample, posterior

    # -- the round trip -----------------------------------------------------------------------
    def raw_latents(self, vae: Any, pixels: Tensor, *, sample: bool = False, generator: Any = None) -> Tensor:
        """The posterior mean (or a sample) of `pixels`, float32, before normalization."""
        dist = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
        return (dist.sample(generator) if sample else dist.mean).float()

    def to_policy(self, z: Tensor, video: bool) -> Tensor:
        """The VAE's latents in the layout the policy samples (an image model drops the frame axis)."""
        return z[:, :, 0] if (self.video_vae and not video) else z

    def from_policy(self, x: Tensor) -> Tensor:
        return x.unsqueeze(2) if (self.video_vae and x.ndim == 4) else x

    @no_grad
    def encode(self, vae: Any, media: Any, *, video: bool, sample: bool = False, generator: Any = None) -> Tensor:
        z = self.raw_latents(vae, self.pixels(as_uint8_media(media, video)), sample=sample, generator=generator)
        return self.normalize(vae, self.to_policy(z, video))

    @no_grad
    def decode(self, vae: Any, latents: Tensor) -> Tensor:
        video = latents.ndim == 5
        z = self.from_policy(self.denormalize(vae, latents.float()))
        pixels = vae.decode(z.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return self.media(pixels, video)


class ShiftScale(LatentCodec):
    """SD3: x = (z - shift_factor) * scaling_factor."""

    def _constants(self, vae: Any) -> tuple[float, float]:
        return float(vae.config.scaling_factor), float(vae.config.shift_factor or 0.0)

    def normalize(self, vae: Any, z: Tensor) -> Tensor:
        scale, shift = self._constants(vae)
        return (z - shift) * scale

    def denormalize(self, vae: Any, x: Tensor) -> Tensor:
        scale, shift = self._constants(vae)
        return x / scale + shift

    def fit(self, vae: Any, z: Tensor) -> dict[str, float]:
        shift, scale = float(z.mean()), float(1.0 / z.std().clamp_min(1e-6))
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        return {"vae_shift_factor": shift, "vae_scaling_factor": scale}


class Scale(ShiftScale):
    """HunyuanVideo: x = z * scaling_factor (its VAE config has no shift)."""

    video_vae = True

    def _constants(self, vae: Any) -> tuple[float, float]:
        return float(vae.config.scaling_factor), 0.0

    def fit(self, vae: Any, z: Tensor) -> dict[str, float]:
        scale = float(1.0 / z.std().clamp_min(1e-6))
        vae.register_to_config(scaling_factor=scale)
        return {"vae_scaling_factor": scale}


class ChannelStats(LatentCodec):
    """Wan, Qwen-Image: x[:, c] = (z[:, c] - latents_mean[c]) / latents_std[c] (a video VAE)."""

    video_vae = True

    def _stats(self, vae: Any, like: Tensor) -> tuple[Tensor, Tensor]:
        import torch  # start-up time: loaded on first use, not when a recipe is read

        shape = (1, -1) + (1,) * (like.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=like.device).view(shape)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=like.device).view(shape)
        return mean, std

    def normalize(self, vae: Any, z: Tensor) -> Tensor:
        mean, std = self._stats(vae, z)
        return (z - mean) / std

    def denormalize(self, vae: Any, x: Tensor) -> Tensor:
        mean, std = self._stats(vae, x)
        return x * std + mean

    def reconstruction(self, vae: Any, pixels: Tensor) -> tuple[Tensor, Any]:
        """The decoder's own output, before the clamp to [-1, 1] these VAEs end their decode with:
        trained through the clamp, a decoder that overshoots white (the toy scenes' background)
        gets no gradient on the pixels it overshoots and settles on a blank frame."""
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        posterior = vae.encode(pixels).latent_dist
        frames: list[Tensor] = []
        handle = vae.decoder.register_forward_hook(lambda module, args, out: frames.append(out))
        try:
            vae.decode(posterior.mean)
        finally:
            handle.remove()
        out = torch.cat(frames, dim=2)
        if getattr(vae.config, "patch_size", None):
            # start-up time: diffusers loads on first use, not when a recipe is read
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out, posterior

    def fit(self, vae: Any, z: Tensor) -> dict[str, float]:
        dims = [d for d in range(z.ndim) if d != 1]
        mean, std = z.mean(dim=dims), z.std(dim=dims).clamp_min(1e-6)
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
        return {"vae_latent_mean": float(mean.mean()), "vae_latent_std": float(std.mean())}


def patchify(z: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2): each 2x2 block's channels stacked (FLUX.2's layout)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: Tensor) -> Tensor:
    """Inverse of `patchify`."""
    b, c4, h, w = x.shape
    return x.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


class PatchBatchNorm(LatentCodec):
    """FLUX.2: x = (patchify(z) - bn.running_mean) / sqrt(bn.running_var + eps), per channel."""

    def _stats(self, vae: Any, like: Tensor) -> tuple[Tensor, Tensor]:
        import torch  # start-up time: loaded on first use, not when a recipe is read

        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, torch.float32)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(like.device, torch.float32) + vae.config.batch_norm_eps)
        return mean, std

    def normalize(self, vae: Any, z: Tensor) -> Tensor:
        z = patchify(z)
        mean, std = self._stats(vae, z)
        return (z - mean) / std

    def denormalize(self, vae: Any, x: Tensor) -> Tensor:
        mean, std = self._stats(vae, x)
        return unpatchify(x * std + mean)

    @no_grad
    def fit(self, vae: Any, z: Tensor) -> dict[str, float]:
        p = patchify(z)
        dims = [0, 2, 3]
        mean, var = p.mean(dim=dims), p.var(dim=dims)
        vae.bn.running_mean.copy_(mean.to(vae.bn.running_mean))
        vae.bn.running_var.copy_((var - vae.config.batch_norm_eps).clamp_min(1e-6).to(vae.bn.running_var))
        return {"vae_latent_mean": float(mean.mean()), "vae_latent_std": float(var.sqrt().mean())}


# The VAE warm-up of a tiny flow model's SFT (stages/diffusion/sft.py runs it)


def to_pixels(images: np.ndarray | Tensor) -> Tensor:
    """uint8 (B, H, W, 3) -> float32 (B, 3, H, W) in [-1, 1] (the VAE's input range); videos
    (B, F, H, W, 3) -> (B, 3, F, H, W)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

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
    import torch  # start-up time: loaded on first use, not when a recipe is read

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


@no_grad
def standardize_latents(vae: Any, images: np.ndarray, batch: int = 256) -> dict[str, float]:
    """Set the VAE's `shift_factor` and `scaling_factor` so the normalized latents
    (z - shift) * scale of `images` have mean 0 and std 1 (what flow matching from N(0, 1) noise
    assumes; SD3's constants fit only SD3's own VAE)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    device = next(vae.parameters()).device
    zs = [vae.encode(to_pixels(images[i:i + batch]).to(device)).latent_dist.mean.float().cpu()
          for i in range(0, len(images), batch)]
    return ShiftScale().fit(vae, torch.cat(zs))

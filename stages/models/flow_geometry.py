"""How a flow family's pixels map to the latents the flow policy samples and to the transformer's
tokens: one `FlowGeometry` per loaded model (or per recipe, read from its configs before anything
loads), so an image side or a frame count the model cannot take is an error naming the recipe
field before any compute.

    pixels (F, H, W)  --VAE-->  latents (C, F', H/s, W/s)  --patch-->  tokens F'/pt * (H/s/p) * (W/s/p)

`s` (`spatial`) is every fixed spatial factor between pixels and the policy's latents (the VAE's
downsampling, times a packing such as FLUX.2's 2x2 patchify); `p` the transformer's patch on those
latents. Video VAEs are causal in time: F = 1 + t * (F' - 1) pixel frames for F' latent frames,
t = `temporal`; some also encode in chunks (`frame_step`: Wan's encoder reads 1 + 4k frames).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def check_image_side(field: str, size: int, vae_factor: int, patch: int) -> None:
    """ValueError naming `field` unless the VAE (downsampling by `vae_factor`) and the transformer
    (patch `patch`) can take images of side `size`."""
    step = vae_factor * patch
    if size % step:
        ok = ", ".join(str(step * k) for k in range(max(1, size // step - 1), size // step + 3))
        raise ValueError(
            f"{field}: image size {size} cannot be taken by the VAE (downsamples by {vae_factor}) and the "
            f"transformer (patch {patch}): use a multiple of {step} (e.g. {ok})"
        )


def check_size(what: str, size: int, vae_factor: int, patch: int, max_patches: int | None) -> None:
    """ValueError, saying which sides work, unless `what` (a loaded model) takes image side `size`."""
    step = vae_factor * patch
    largest = None if max_patches is None else step * max_patches
    if size > 0 and size % step == 0 and (largest is None or size <= largest):
        return
    upto = f" up to {largest}" if largest is not None else ""
    raise ValueError(
        f"image size {size} cannot be taken by {what}: the VAE downsamples by {vae_factor} and the "
        f"transformer patch is {patch}, so image sides must be multiples of {step}{upto} "
        f"(e.g. {', '.join(str(step * k) for k in (1, 2, 4, 8) if largest is None or step * k <= largest)})"
    )


@dataclass(frozen=True)
class FlowGeometry:
    """channels: C of the policy's latents; spatial: pixels per latent pixel; patch: latent pixels
    per token side; temporal: pixel frames per latent frame after the first (None: an image model);
    frame_step: the VAE encodes 1 + k * frame_step frames; patch_t: latent frames per token;
    max_patches: the largest token grid side (a position table), None when unbounded; what: the
    model, for messages."""

    channels: int
    spatial: int
    patch: int
    temporal: int | None = None
    frame_step: int = 1
    patch_t: int = 1
    max_patches: int | None = None
    what: str = "the model"

    @property
    def video(self) -> bool:
        return self.temporal is not None

    @property
    def vae_factor(self) -> int:
        return self.spatial

    def check_side(self, size: int, field: str | None = None) -> None:
        """ValueError (prefixed by `field` when given) unless images / frames of side `size` fit."""
        try:
            check_size(self.what, int(size), self.spatial, self.patch, self.max_patches)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}" if field else str(exc)) from None

    def frame_rule(self) -> int:
        """Pixel frames between two valid frame counts: F = 1 + k * rule."""
        t = self.temporal or 1
        rule = t * self.patch_t
        return rule * self.frame_step // math.gcd(rule, self.frame_step)

    def check_frames(self, frames: int | None, field: str | None = None) -> None:
        """ValueError naming `field` unless this model takes clips of `frames` frames (an image
        model takes none)."""
        where = f"{field}: " if field else ""
        if not self.video:
            if frames is not None:
                raise ValueError(f"{where}{self.what} makes images, not videos; remove the frame count")
            return
        rule = self.frame_rule()
        if frames is None or frames < 1 or (frames - 1) % rule:
            got = "no frame count" if frames is None else f"{frames} frames"
            examples = ", ".join(str(1 + rule * k) for k in range(1, 4))
            raise ValueError(
                f"{where}{got} cannot be taken by {self.what}: its VAE compresses time by {self.temporal} "
                f"(encoding 1 + {self.frame_step}k frames) and the transformer's time patch is {self.patch_t}, so "
                f"clips need 1 + {rule}k frames (e.g. {examples})"
            )

    def latent_frames(self, frames: int) -> int:
        return 1 + (frames - 1) // (self.temporal or 1)

    def latent_shape(self, size: int, frames: int | None = None) -> tuple[int, ...]:
        """(C, h, w) for an image of side `size`, (C, F', h, w) for a clip of `frames` frames."""
        self.check_side(size)
        self.check_frames(frames)
        side = size // self.spatial
        if not self.video:
            return self.channels, side, side
        assert frames is not None, "check_frames: a video model takes a frame count"
        return self.channels, self.latent_frames(int(frames)), side, side

    def tokens(self, shape: tuple[int, ...]) -> int:
        """Transformer tokens of one latent of `shape` (what a dynamic shift is computed from)."""
        grid = (shape[-2] // self.patch) * (shape[-1] // self.patch)
        return grid * (shape[1] // self.patch_t if len(shape) == 4 else 1)

"""Media in shards: images as PNG bytes (lossless, for rewards and previews) and back."""
from __future__ import annotations

import io
from typing import Any

import numpy as np


def to_pil(images: Any) -> list[Any]:
    """uint8 (B, H, W, 3) -> list of PIL RGB images."""
    from PIL import Image

    return [Image.fromarray(np.asarray(im), "RGB") for im in np.asarray(images)]


def to_png_bytes(images: Any) -> list[bytes]:
    """uint8 (B, H, W, 3) -> PNG bytes per image (lossless, for shards and rewards)."""
    out = []
    for im in to_pil(images):
        buf = io.BytesIO()
        im.save(buf, format="PNG", compress_level=1)  # fastest zlib level: 1.7x faster, 2% larger at 32x32
        out.append(buf.getvalue())
    return out


def decode_png(data: bytes) -> Any:
    """PNG bytes of a shard -> RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")

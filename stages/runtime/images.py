"""The images a prompt is conditioned on (vision-language models), as the data plane carries them.

A prompt's images are encoded once, as PNG bytes, when its source draws it (stages/sources/), and
stored with their patch grids in `requests.arrow`; the worker copies both into every rollout row of
the prompt's group, so sampling, scoring and the trainer's replay read them from the shard alone,
never from the original dataset.

    images       list<binary>            PNG bytes, one per image of the prompt (1 or more)
    image_grids  list<list<int32>>       (t, h, w) patches of each image, as the model family's
                                          image processor cuts it (`Family.image_grids`)

A bad image fails naming the sample (or the data file's line) and the file: bytes that do not
decode, a path that does not exist, a stored grid that is not what the processor makes of it.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from unirl.stages.runtime.registry import families

IMAGE_COLUMNS: dict[str, pa.DataType] = {
    "images": pa.list_(pa.binary()),
    "image_grids": pa.list_(pa.list_(pa.int32())),
}


class ImageError(ValueError):
    """An image that cannot condition a prompt; the message names the sample or row and the file."""


def png_bytes(image: Any) -> bytes:
    """A PIL image as lossless RGB PNG bytes."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def decode(data: bytes, where: str) -> Any:
    """Image bytes (PNG, JPEG, any format PIL reads) -> an RGB PIL image, read whole now: a
    truncated or corrupt file fails here, naming `where`, not inside the model."""
    from PIL import Image, UnidentifiedImageError  # start-up time: PIL loads on first use, not when a recipe is read

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"{where}: the image bytes do not decode ({type(exc).__name__}: {exc}); "
                         "give a PNG or JPEG file") from None


def load_image_value(value: Any, base: Path, where: str) -> bytes:
    """One image of a data file (a path, relative to the file's folder or absolute, or the bytes
    themselves, as Parquet stores them) -> PNG bytes, decoded whole to prove it is an image."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return png_bytes(decode(bytes(value), where))
    if isinstance(value, dict) and "bytes" in value:  # Hugging Face datasets' Image feature in Parquet
        if value.get("bytes"):
            return png_bytes(decode(value["bytes"], where))
        value = value.get("path")
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ImageError(f"{where}: an image must be a file path or image bytes, got {type(value).__name__}")
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise ImageError(f"{where}: image file {path} does not exist")
    return png_bytes(decode(path.read_bytes(), f"{where}: image file {path}"))


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes, from the header alone."""
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    with Image.open(io.BytesIO(data)) as im:
        return im.size


def with_image_grids(recipe: Any, rows: list[dict[str, Any]], images: list[tuple[bytes, ...]],
                     names: list[str]) -> list[dict[str, Any]]:
    """`rows` with `images` (PNG bytes per row) and the patch grid the model family's image
    processor cuts each into, for a family that takes images; one without any is an error."""
    family = families.get(recipe.model.kind)
    if not family.takes_images:
        return rows
    for row, pngs, name in zip(rows, images, names):
        if not pngs:
            raise ValueError(f"{name}: model.kind {recipe.model.kind!r} needs one or more images with every prompt; "
                             "this one has none")
        grids = family.image_grids(recipe.model, [image_size(png) for png in pngs])
        row.update(images=list(pngs), image_grids=[list(g) for g in grids])
    return rows

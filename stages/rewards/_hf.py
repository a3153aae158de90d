"""Plumbing shared by the model-based scorers: local-directory checks, device/dtype choice,
micro-batching and the batch fields a scorer needs. Imports torch only inside functions, so the
scorer registry can import every scorer module without loading torch."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.stages.rewards.base import ScoreBatch

if TYPE_CHECKING:
    import torch


def local_dir(path: str | Path, scorer: str, what: str = "model_path") -> str:
    """The path as a string, after checking it is a local directory (weights are never fetched)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"scorer {scorer!r}: {what} {str(path)!r} is not a directory; scorers load weights "
            "from a local directory in Hugging Face layout (save_pretrained / a downloaded snapshot)"
        )
    return str(p)


def pick_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else is passed to torch.device."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str) -> torch.dtype:
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def micro_batches(n: int, size: int) -> Iterator[slice]:
    """Slices covering range(n) in order, each at most `size` long."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def need_images(batch: ScoreBatch, scorer: str) -> list[Any]:
    if batch.images is None:
        hint = " (wrap it in `video` to score video frames)" if batch.videos is not None else ""
        raise ValueError(f"scorer {scorer!r} needs images (ScoreBatch.images) and the batch has none{hint}")
    return batch.images

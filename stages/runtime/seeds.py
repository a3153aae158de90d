"""Seeds derived from names, the same in every process and Python version (unlike the salted
builtin hash()): a sample's randomness depends on what it is (run seed, iteration, sample id),
never on the batch, rank or process that draws it, so a resumed run draws the same numbers."""
from __future__ import annotations

import hashlib


def derive_seed(*parts: object, sep: str = "/") -> int:
    """A 63-bit seed from `parts` joined by `sep` (sha256, first 8 bytes little-endian)."""
    digest = hashlib.sha256(sep.join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def batch_indices(step: int, *, seed: int, batch_size: int, num_records: int) -> list[int]:
    """The records of SFT step `step`: a function of (seed, step) only, so chunks of steps give
    what one long call gives."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    g = torch.Generator().manual_seed(derive_seed(seed, "sft-batch", step))
    return torch.randint(0, num_records, (batch_size,), generator=g).tolist()

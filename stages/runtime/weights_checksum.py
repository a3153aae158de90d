"""One checksum of a set of named tensors, the same on both sides of a weight sync: the trainer
computes it over the tensors it publishes, the engine over what it holds after loading them, so a
load that skipped or mangled a tensor is caught (sha256 over the names in order, each name's
bytes followed by the tensor's raw bytes: SGLang diffusion's `compute_weights_checksum` scheme)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


def tensors_checksum(named: Iterable[tuple[str, Any]]) -> str:
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(memoryview(t.view(torch.uint8).numpy()))  # no copy of the bytes
    return h.hexdigest()

"""The math of the run, on tensors, with nothing of the run around it (docs/architecture.md, "The
math contract"): group advantages, loss aggregation, KL estimators, the token and flow policy
losses, the off-policy correction's weights, the behaviour check. Each states its formula in its
docstring and has hand-computed tests. This package's own import loads nothing heavy; its modules
import torch."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def no_grad(fn: F) -> F:
    """`torch.no_grad()` as a decorator that imports torch at the first call, not at the import of
    the module it decorates (start-up time: reading a recipe imports every model family)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch  # start-up time: torch loads on first use, not when a recipe is read

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

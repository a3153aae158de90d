"""Pays at the quickstart geometry: 51 -> 1.5 ms of bookkeeping on an iteration's critical path
(benchmarks/README.md, "Orchestration cost per iteration").

The run loop's bookkeeping, off the critical path: what an iteration reports (MLflow metrics,
the rollout preview, the model registry, the Prefect progress artifact) is done in order on one
background thread while the next iteration's flow run starts.

Nothing downstream waits for it: the next iteration reads only committed stage outputs, and an
iteration counts once its `_SUCCESS` is written (on the caller's thread, before its bookkeeping
is queued). A run killed before its queue drained has MLflow steps missing for committed
iterations; the resumed run does their bookkeeping again from their `_SUCCESS` (flows/rl.py
`catch_up`), and the tracker logs a step once, so nothing is lost and nothing is logged twice. A failed job fails the run: its error is
raised on the caller's thread at the next `submit` or at `close`.

Every job runs in a copy of the caller's context (Prefect's run context: artifacts and loggers
see the `rl-train` flow run).
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Bookkeeping:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unirl-bookkeeping")
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue `fn(*args, **kwargs)` after everything queued before it."""
        self._raise_failed()
        ctx = contextvars.copy_context()
        self._pending.append(self._pool.submit(ctx.run, fn, *args, **kwargs))

    def _raise_failed(self) -> None:
        """Raise the first failure among the finished jobs (once), forgetting the finished ones."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def drain(self) -> None:
        """Wait for everything queued; raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

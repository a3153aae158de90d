"""One run's events, many readers.

The run loop (flows/rl.py `train_run`) says what happened and nothing else; who shows, logs or
publishes it subscribes (flows/readers.py: the console, MLflow, the model registry, previews,
Prefect artifacts). The events, in the order a run emits them:

    RunStarted(first)                       before the first iteration this run does (resumed: first > 0)
    EvaluationStarted(version, split)       a held-out evaluation is about to be computed (minutes on a big split)
    EvaluationDone(version, split, ...)     its metrics (the test split: after RL, beside its value before RL)
    IterationEnded(iteration, summary)      an iteration trained; its version's evaluation and its commit follow
    VersionPublished(version)               the iteration closed a policy version (rollout accumulation: a window)
    IterationCommitted(iteration, summary)  its `_SUCCESS` is written: it counts
    RunFinished(ok)                         the run ended (ok False: it failed; the error is the loop's to raise)

A resumed run replays what a killed run had committed but not reported (`replayed=True`): the
readers that keep their own record in storage (MLflow, the registry) take it, the console does not
print it again.

A reader is an object with `on(event)`. A foreground reader runs on the loop's thread as the event
is emitted (the console: its lines in order with the loop's own). A background reader runs on one
background thread in emission order, off the iteration's critical path (51 -> 1.5 ms at the
quickstart geometry: benchmarks/README.md, "Orchestration cost per iteration"), in a copy of the
emitter's context (Prefect's run context: artifacts and loggers see the `rl-train` flow run).
Nothing downstream waits for it: the next iteration reads only committed stage outputs. A run
killed before the lane drained has MLflow steps missing for committed iterations; the resumed run
replays them (flows/rl.py `catch_up`), and the tracker logs a step once, so nothing is lost and
nothing is logged twice. A failed background job fails the run: its error is raised on the loop's
thread at the next emit or at `close`.
"""
from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RunStarted:
    first: int


@dataclass(frozen=True)
class EvaluationStarted:
    version: int
    split: str = "dev"
    note: str = ""  # how it samples, or when it is reported


@dataclass(frozen=True)
class EvaluationDone:
    version: int
    metrics: dict[str, float]
    split: str = "dev"
    label: str = ""  # "before RL", "after RL", or none
    before: dict[str, float] | None = None  # the test split: its value before RL
    replayed: bool = False


@dataclass(frozen=True)
class IterationEnded:
    iteration: int
    summary: dict[str, Any]


@dataclass(frozen=True)
class VersionPublished:
    version: int
    replayed: bool = False


@dataclass(frozen=True)
class IterationCommitted:
    iteration: int
    summary: dict[str, Any]
    replayed: bool = False


@dataclass(frozen=True)
class RunFinished:
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)


Event = RunStarted | EvaluationStarted | EvaluationDone | IterationEnded | VersionPublished | IterationCommitted | RunFinished


class Reader(Protocol):
    def on(self, event: Event) -> None: ...


class Lane:
    """One background thread that runs jobs in order, each in a copy of its caller's context."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unirl-events")
        self._pending: list[Future] = []
        self.closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, check: bool = True) -> None:
        """Queue `fn(*args)` after everything queued before it; with `check`, first raise the first
        failure among the finished jobs (once)."""
        if check:
            self._raise_failed()
        ctx = contextvars.copy_context()
        self._pending.append(self._pool.submit(ctx.run, fn, *args))

    def _raise_failed(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def close(self) -> None:
        """Wait for everything queued; raise the first failure."""
        pending, self._pending, self.closed = self._pending, [], True
        try:
            for future in pending:
                future.result()
        finally:
            self._pool.shutdown(wait=True)


class RunEvents:
    """The bus: `subscribe` readers, `emit` events, `close` at the run's end."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        self._readers: list[tuple[Reader, bool]] = []
        self._lane = Lane()
        self._log = log or logging.getLogger("unirl.events")

    def subscribe(self, reader: Reader, *, background: bool = False) -> None:
        self._readers.append((reader, background))

    def emit(self, event: Event) -> None:
        """Tell the foreground readers now, then queue one job that tells the background ones."""
        for reader, background in self._readers:
            if not background:
                reader.on(event)
        if any(background for _, background in self._readers):
            self._lane.submit(self._tell, event, [r for r, background in self._readers if background])

    @staticmethod
    def _tell(event: Event, readers: list[Reader]) -> None:
        """Every reader hears the event, also when one before it failed; then the first failure is raised."""
        failed: Exception | None = None
        for reader in readers:
            try:
                reader.on(event)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others heard it
                failed = failed or exc
        if failed is not None:
            raise failed

    def close(self, finished: RunFinished | None) -> None:
        """Emit `finished` (if any) and wait for the background readers. A run that failed
        (`finished.ok` false) tells every reader, whatever failed before; what fails now is
        logged, not raised: the run's own error is the one to raise."""
        if finished is None or finished.ok:
            if finished is not None:
                self.emit(finished)
            self._lane.close()
            return
        foreground = [r for r, b in self._readers if not b]
        background = [r for r, b in self._readers if b]
        for tell in (lambda: self._tell(finished, foreground), lambda: self._end_lane(finished, background)):
            try:
                tell()
            except Exception as exc:  # noqa: BLE001 - see above
                self._log.warning("reporting the run after the failure also failed: %s: %s", type(exc).__name__, exc)

    def _end_lane(self, finished: RunFinished, background: list[Reader]) -> None:
        if self._lane.closed:  # its close raised (a reader failed at the run's successful end): told here
            self._tell(finished, background)
        else:
            self._lane.submit(self._tell, finished, background, check=False)
            self._lane.close()

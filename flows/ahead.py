"""Pays at the quickstart geometry: 215-255 against 277-308 ms per AR quickstart iteration on 2
cores (benchmarks/README.md, "Orchestration cost per iteration").

Iteration flow runs started one ahead: Prefect's fixed cost of starting a flow run (a parent task
run, the flow run, its Running state and name: ~150 ms of API round trips per iteration on a
2-core machine, benchmarks/README.md) is paid while the previous iteration still works.

Iteration i+1's flow run is started on a thread of its own as soon as iteration i's body begins;
its body then waits at a gate until the run loop has finished with iteration i (held-out
evaluation, `_SUCCESS`) and opens it. Likewise the end of a flow run (its Completed state, ~30
ms) overlaps what follows: the body hands its result to the run loop as it returns. Nothing of iteration i+1 runs before that, so the order of
the work, its data and its results are those of one iteration after the other; only Prefect's
bookkeeping overlaps (in the UI, iteration i+1 is Running, waiting at its gate, while iteration
i finishes). A run that stops (the last iteration done, a failure, Ctrl-C) cancels the waiting
flow run: it ends Cancelled, having done nothing.

Each flow run is called in a copy of the loop's context (the `rl-train` flow run, its tags and
settings), so it is a subflow of the training run as before.
"""
from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Gate:
    began: threading.Event = field(default_factory=threading.Event)  # the body started
    opened: threading.Event = field(default_factory=threading.Event)
    handed: threading.Event = field(default_factory=threading.Event)  # the body's result is ready
    result: Any = None
    cancelled: bool = False


_GATES: dict[tuple[str, int], Gate] = {}  # (run name, iteration) -> gate; owned by a live `Ahead`
_LOCK = threading.Lock()


def wait_turn(run_name: str, iteration: int) -> bool:
    """Called first in an iteration's body: say it began, then wait for its turn. False when the
    run stopped meanwhile (the body must do nothing). An iteration run without `Ahead` (a
    deployment of the iteration flow alone, a test) has no gate and goes at once."""
    with _LOCK:
        gate = _GATES.get((run_name, iteration))
    if gate is None:
        return True
    gate.began.set()
    gate.opened.wait()
    return not gate.cancelled


def hand_over(run_name: str, iteration: int, result: Any) -> Any:
    """Called last in an iteration's body with what it returns: the run loop may go on with it
    while Prefect ends the flow run (its Completed state) on the iteration's thread."""
    with _LOCK:
        gate = _GATES.get((run_name, iteration))
    if gate is not None:
        gate.result = result
        gate.handed.set()
    return result


class Ahead:
    """Runs `iteration_flow(i)` for i in order, each started while its predecessor works.

    `take(i)` returns iteration i's result (what its body hands over) once the body is done, with
    iteration i+1 (if i+1 < `end`) started and waiting at its gate; Prefect ends flow run i
    meanwhile, and its outcome is checked at the next `take` (after letting i+1 go) or at
    `close`, which also cancels whatever waits."""

    def __init__(self, run_name: str, end: int, iteration_flow: Callable[[int], Any]):
        self.run_name, self.end, self.iteration_flow = run_name, end, iteration_flow
        self._threads: dict[int, tuple[threading.Thread, Gate, dict[str, Any]]] = {}

    def _start(self, i: int) -> None:
        gate = Gate()
        with _LOCK:
            _GATES[(self.run_name, i)] = gate
        out: dict[str, Any] = {}
        ctx = contextvars.copy_context()

        def run() -> None:
            try:
                out["result"] = ctx.run(self.iteration_flow, i)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread by take()
                out["error"] = exc
            finally:
                gate.began.set()  # a flow run that failed before its body also lets take() go on

        thread = threading.Thread(target=run, name=f"unirl-iter-{i:06d}", daemon=True)
        self._threads[i] = (thread, gate, out)
        thread.start()

    def take(self, i: int) -> Any:
        if i not in self._threads:
            self._start(i)
        thread, gate, out = self._threads[i]
        gate.opened.set()
        self._finish_ended(keep=i)
        gate.began.wait()
        if i + 1 < self.end and i + 1 not in self._threads and "error" not in out:
            self._start(i + 1)
        while not gate.handed.wait(0.05):  # the body's result, or the flow run's end without one
            if not thread.is_alive():
                break
        if "error" in out:
            self._forget(i)
            raise out["error"]
        if not gate.handed.is_set():  # ended without handing over (a body that returns early)
            self._forget(i)
            return out["result"]
        return gate.result

    def _finish_ended(self, keep: int) -> None:
        """Join the flow runs before `keep` (their bodies are done; Prefect was ending them) and
        raise the first failure of their ending."""
        for j in sorted(k for k in self._threads if k < keep):
            thread, _, out = self._threads[j]
            thread.join()
            self._forget(j)
            if "error" in out:
                raise out["error"]

    def _forget(self, i: int) -> None:
        self._threads.pop(i, None)
        with _LOCK:
            _GATES.pop((self.run_name, i), None)

    def close(self) -> None:
        """Wait for the flow runs Prefect is ending, cancel the ones waiting at their gates, and
        raise the first failure of an ending."""
        failure = None
        for i, (thread, gate, out) in sorted(self._threads.items()):
            if not gate.handed.is_set():
                gate.cancelled = True
                gate.opened.set()
            thread.join(timeout=60)
            if gate.handed.is_set() and "error" in out and failure is None:
                failure = out["error"]
            with _LOCK:
                _GATES.pop((self.run_name, i), None)
        self._threads.clear()
        if failure is not None:
            raise failure

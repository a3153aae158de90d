"""Iteration flow runs started ahead (flows/ahead.py): the next one is started while the current
one works, but its body waits for its turn, so the work happens one iteration after the other;
a run that stops cancels the one waiting."""
from __future__ import annotations

import threading
import time

import pytest

from unirl.flows.ahead import Ahead, wait_turn


def recorder():
    log: list[str] = []
    lock = threading.Lock()

    def note(what: str) -> None:
        with lock:
            log.append(what)

    def iteration(i: int) -> int:
        note(f"start {i}")  # what Prefect does before the body: creating the flow run
        if not wait_turn("run", i):
            note(f"cancelled {i}")
            return -1
        note(f"body {i}")
        time.sleep(0.05)
        note(f"end {i}")
        return i * 10

    return log, iteration


def test_the_next_flow_run_starts_during_the_current_body_and_works_only_after_its_turn():
    log, iteration = recorder()
    ahead = Ahead("run", 3, iteration)
    assert ahead.take(0) == 0
    time.sleep(0.05)
    assert log.index("start 1") < log.index("end 0")  # started while iteration 0 worked
    assert "body 1" not in log  # ... but waits at its gate while the run loop finishes 0
    assert [ahead.take(1), ahead.take(2)] == [10, 20]
    bodies = [e for e in log if not e.startswith("start")]
    assert bodies == ["body 0", "end 0", "body 1", "end 1", "body 2", "end 2"]
    assert log.count("start 3") == 0  # nothing is started past the last iteration
    ahead.close()


def test_a_run_that_stops_cancels_the_waiting_flow_run():
    log, iteration = recorder()
    ahead = Ahead("run", 5, iteration)
    ahead.take(0)
    ahead.close()
    assert log[-1] == "cancelled 1" and "body 1" not in log
    assert wait_turn("run", 1)  # no gate left behind: an iteration run alone goes at once


def test_a_failed_iteration_raises_in_the_loop_and_the_next_one_does_nothing():
    bodies = []

    def iteration(i: int) -> int:
        if wait_turn("run", i):
            bodies.append(i)
            raise RuntimeError(f"iteration {i} failed")
        return -1

    ahead = Ahead("run", 3, iteration)
    with pytest.raises(RuntimeError, match="iteration 0 failed"):
        ahead.take(0)
    ahead.close()
    assert bodies == [0]

"""benchmarks/iteration_profile.py: a timeline of marks from several threads is cut into rows that
add up to each iteration's window, with the next flow run's start overlapped or not."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("iteration_profile", Path(__file__).parents[2] / "benchmarks" / "iteration_profile.py")
assert spec is not None and spec.loader is not None
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)


def timeline(marks):
    t = profile.Timeline()
    t.marks = sorted(marks, key=lambda m: m[0])
    return t


BODY_0 = [
    (0.10, "gate<", 0),
    (0.11, "task>generate", 0), (0.12, "call>generate", None), (0.42, "call<generate 0.29", None), (0.43, "task<generate", 0),
    (0.45, "task>score", 0), (0.50, "task<score", 0),
    (0.52, "body<", 0), (0.55, "subflow<", 0),
]


def test_rows_of_one_after_the_other_add_up_to_the_window() -> None:
    t = timeline([(0.0, "subflow>", 0), (0.09, "gate>", 0), *BODY_0, (0.60, "subflow>", 1), (0.69, "gate>", 1), (0.70, "gate<", 1)])
    rows = profile.breakdown(t, 0)
    assert rows["worker: generate"] == pytest.approx(0.29)
    assert rows["control: round trips"] == pytest.approx(0.01)
    assert rows["flow: generate"] == pytest.approx(0.02)  # its task body minus the worker call
    assert rows["flow: score"] == pytest.approx(0.05)
    assert rows["prefect: task runs"] == pytest.approx(0.42 - 0.37)
    assert rows["prefect: subflow end"] == pytest.approx(0.03)
    assert rows["run loop"] == pytest.approx(0.05)
    assert rows["prefect: subflow start (not overlapped)"] == pytest.approx(0.10)
    assert rows["total"] == pytest.approx(0.60)
    assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(rows["total"])
    assert profile.overlapped_start(t, 1) == pytest.approx(0.09)


def test_a_flow_run_started_ahead_hides_its_start_in_the_previous_window() -> None:
    # Iteration 1's flow run starts at 0.11, while 0's body works, and waits at its gate from 0.30;
    # the run loop, going on at 0.52 with 0's result while Prefect ends 0's run, lets 1 go at 0.60
    # (take>): its turn begins at once.
    t = timeline([*BODY_0, (0.11, "subflow>", 1), (0.30, "gate>", 1), (0.60, "take>", 1), (0.601, "gate<", 1)])
    rows = profile.breakdown(t, 0)
    assert rows["prefect: subflow start (not overlapped)"] == pytest.approx(0.001)
    assert rows["prefect: subflow end"] == 0  # the loop went on with the body's result (0.52)
    assert rows["run loop"] == pytest.approx(0.08)
    assert rows["total"] == pytest.approx(0.501)
    assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(rows["total"])
    assert profile.overlapped_start(t, 1) == pytest.approx(0.19)

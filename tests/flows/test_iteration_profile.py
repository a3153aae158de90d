"""benchmarks/iteration_profile.py: a timeline of marks is cut into rows that add up to the
iteration's wall time."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("iteration_profile", Path(__file__).parents[2] / "benchmarks" / "iteration_profile.py")
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)


def test_rows_of_one_iteration_add_up_to_its_wall_time() -> None:
    marks = [
        (0.00, "subflow>"), (0.10, "body>"),
        (0.11, "task>generate"), (0.12, "call>generate"), (0.42, "call<generate 0.29"), (0.43, "task<generate"),
        (0.45, "task>score"), (0.50, "task<score"),
        (0.52, "body<"), (0.55, "subflow<"), (0.60, "subflow>"),
    ]
    rows = profile.breakdown(marks)
    assert rows["prefect: subflow start"] == pytest.approx(0.10)
    assert rows["worker: generate"] == pytest.approx(0.29)
    assert rows["control: round trips"] == pytest.approx(0.01)
    assert rows["flow: generate"] == pytest.approx(0.02)  # its task body minus the worker call
    assert rows["flow: score"] == pytest.approx(0.05)
    assert rows["prefect: task runs"] == pytest.approx(0.42 - 0.37)
    assert rows["prefect: subflow end"] == pytest.approx(0.03)
    assert rows["run loop"] == pytest.approx(0.05)
    assert rows["total"] == pytest.approx(0.60)
    assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(rows["total"])
    timeline = profile.Timeline()
    timeline.marks = marks + [(0.9, "subflow<")]
    assert timeline.iterations() == [marks]  # from one start up to and including the next

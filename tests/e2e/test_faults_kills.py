"""The fault table's SIGKILL rows (benchmarks/faults.py) at tiny size: one run folder is killed in
each stage in turn, then the same command resumes it and ends exactly where an uninterrupted run
does (per-iteration metrics, MLflow history, final weights' sha256). The other rows are in
test_faults_ranks.py and test_faults_outages.py (split by the reference run they compare with, so
the suite's two workers share the table)."""
from __future__ import annotations

import pytest

from tests.e2e.faults_bench import bench, check, faults  # noqa: F401 - bench is a fixture

pytestmark = pytest.mark.slow


def test_sigkill_in_every_stage(bench):
    rows = faults.kill_rows(bench, chained=True)
    assert [r.fault for r in rows] == [fault for fault, _ in faults.KILLS]
    check(rows, bench)
    assert "replaying" in rows[0].seen or "checkpoint" in rows[0].seen

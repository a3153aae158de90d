"""Fault-table rows (benchmarks/faults.py) about the worker group and its checkpoints: a rank
killed mid-train at world size 2, and checkpoints without their commit marker or with corrupted
files; each ends in a clear error or is passed over, and the rerun ends where an uninterrupted run
does."""
from __future__ import annotations

import pytest

from tests.e2e.faults_bench import bench, check, faults  # noqa: F401 - bench is a fixture

pytestmark = pytest.mark.slow


def test_a_killed_rank_is_named_and_the_rerun_resumes(bench):
    row = faults.rank_row(bench)
    assert "rank 1 (local rank 1, pid " in row.seen and "exited with signal SIGKILL during 'train'" in row.seen
    check([row])


def test_uncommitted_and_corrupted_checkpoints_are_passed_over(bench):
    check(faults.checkpoint_rows(bench))

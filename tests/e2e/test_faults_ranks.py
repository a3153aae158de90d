"""Fault-table rows (benchmarks/faults.py) about the worker group and its checkpoints: a rank
killed mid-train at world size 2, and checkpoints without their commit marker or with corrupted
files; each ends in a clear error or is passed over, and the rerun ends where an uninterrupted run
does."""
from __future__ import annotations

import re

import pytest

from tests.e2e.faults_bench import bench, check, faults  # noqa: F401 - bench is a fixture

pytestmark = pytest.mark.slow


def test_a_killed_rank_is_named_and_the_rerun_resumes(bench):
    row = faults.rank_row(bench)
    # How the flow notices (rank 0's connection closes, or its poll finds the group gone) is a race;
    # either way the error names the rank, the signal and the command.
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) exited with signal SIGKILL (\(it closed the connection\) )?during 'train'",
                     row.seen), row.seen
    check([row], bench)


def test_uncommitted_and_corrupted_checkpoints_are_passed_over(bench):
    check(faults.checkpoint_rows(bench), bench)

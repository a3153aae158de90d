"""Fault-table rows (benchmarks/faults.py) about what a run depends on: S3 (moto) stopped mid-run
and a second start of the same run, a full disk, the reward server down and back; each is retried
or fails clearly, and the rerun ends where an uninterrupted run does."""
from __future__ import annotations

import pytest

from tests.e2e.faults_bench import bench, check, faults  # noqa: F401 - bench is a fixture

pytestmark = pytest.mark.slow


def test_s3_outage_is_retried_and_a_second_start_refused(bench):
    row = faults.s3_row(bench)
    assert "is being run by host" in row.seen, row.seen
    check([row], bench)


def test_disk_full_is_a_clear_error_and_commits_nothing(bench):
    check([faults.disk_full_row(bench)], bench)


def test_reward_server_down_then_up(bench):
    check([faults.reward_server_row(bench)], bench)

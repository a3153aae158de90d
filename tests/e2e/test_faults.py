"""The fault table's rows (benchmarks/faults.py) at tiny size: every fault ends in a clear error or
a transparent retry, and the rerun ends exactly where an uninterrupted run does (per-iteration
metrics, MLflow history, final weights' sha256). The SIGKILL rows share one run folder, killed in
each stage in turn, to keep the suite fast."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import faults  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory, prefect_server, mlflow_uri):
    """One work folder and one set of uninterrupted reference runs for every row."""
    from tests.conftest import isolated_env

    work = tmp_path_factory.mktemp("faults")
    env = {**isolated_env(work), "PREFECT_API_URL": prefect_server.url, "MLFLOW_TRACKING_URI": mlflow_uri}
    return faults.Bench(work, env)


def check(rows: list[faults.Row]) -> None:
    for row in rows:
        if row.equal is None:
            pytest.skip(row.seen)
        assert row.equal, row.line()


def test_sigkill_in_every_stage(bench):
    rows = faults.kill_rows(bench, chained=True)
    assert [r.fault for r in rows] == [fault for fault, _ in faults.KILLS]
    check(rows)
    assert "replaying" in rows[0].seen or "checkpoint" in rows[0].seen


def test_a_killed_rank_is_named_and_the_rerun_resumes(bench):
    row = faults.rank_row(bench)
    assert "rank 1 (local rank 1, pid " in row.seen and "exited with signal SIGKILL during 'train'" in row.seen
    check([row])


def test_uncommitted_and_corrupted_checkpoints_are_passed_over(bench):
    check(faults.checkpoint_rows(bench))


def test_s3_outage_is_retried_and_a_second_start_refused(bench):
    row = faults.s3_row(bench)
    assert "is being run by host" in row.seen
    check([row])


def test_disk_full_is_a_clear_error_and_commits_nothing(bench):
    check([faults.disk_full_row(bench)])


def test_reward_server_down_then_up(bench):
    check([faults.reward_server_row(bench)])

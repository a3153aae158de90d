"""What the fault-table test files share (tests/e2e/test_faults_*.py): benchmarks/faults.py
imported as `faults`, the `bench` fixture (a work folder and the uninterrupted reference runs its
rows compare with: one per file, and the files are split by reference so none runs twice), and
`check`, which judges rows and the audits (`unirl audit`) of the runs they resumed."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import faults  # noqa: E402

from tests import zygote  # noqa: E402

faults.popen, faults.run_command = zygote.popen, zygote.run  # `unirl` commands forked warm (tests/zygote.py)


@pytest.fixture(scope="module")
def bench(tmp_path_factory, prefect_server, mlflow_uri):
    from tests.conftest import isolated_env

    work = tmp_path_factory.mktemp("faults")
    env = {**isolated_env(work), **prefect_server.client_env, "MLFLOW_TRACKING_URI": mlflow_uri}
    return faults.Bench(work, env)


def check(rows: list[faults.Row], bench: faults.Bench) -> None:
    """Every row ends where an uninterrupted run does, and every run its rows audited (each
    resumed one, each killed one of a chain) passes `unirl audit`: each group trained once, within
    the staleness bound, weights matching their manifests, the behaviour check held."""
    audits, bench.audits = bench.audits, []
    for row in rows:
        if row.equal is None:
            pytest.skip(row.seen)
    assert audits, "no run of these rows was audited"
    for run, violations in audits:
        assert not violations, f"unirl audit {run}:\n" + "\n".join(violations)
    for row in rows:
        assert row.equal, row.line()

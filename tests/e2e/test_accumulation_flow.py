"""Rollout accumulation through the real CLI (`train.accumulate_rollouts=2`, 4 iterations: 2
updates), killed with SIGKILL mid-window in turn, as the fault table's chained rows are
(benchmarks/faults.py): in iteration 0's report (its line printed, its MLflow step not logged:
the resumed run logs it and must not print it again), in iteration 1's generate (iteration 0's batch committed, no update yet),
at iteration 1's sync (the update taken and committed, no checkpoint of it: the resumed run must
replay it from both batches) and in iteration 3's train (its work done, not committed). The same
command resumes each time; the run ends where an uninterrupted one does (per-iteration metrics,
MLflow history, final weights), took 2 optimizer steps, and passes `unirl audit` after every kill."""
from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import TINY, run_unirl

pytestmark = pytest.mark.slow

ARGS = ["run", str(TINY), "iterations=4", "train.accumulate_rollouts=2", "reward.scorers=[{name: integer_format}]",
        "checkpoint_every=2", "eval.enabled=false"]
KILLS = ["report@0", "generate@1", "sync@1", "train@3"]


def test_a_run_killed_mid_window_resumes_without_loss_or_double_counting(tmp_path, unirl_env):
    from tests.e2e.faults_bench import faults
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    args = [*ARGS, f"storage.root={root}"]
    ref = run_unirl([*args, "--run-name", "ref"], unirl_env)
    lines = [line for line in ref.stdout.splitlines() if line.startswith("[unirl] iter-")]
    assert [("no update yet" in line, "loss" in line) for line in lines] == [(True, False), (False, True)] * 2, ref.stdout
    said = []
    for fault in KILLS:
        killed = run_unirl([*args, "--run-name", "killed"], {**unirl_env, "UNIRL_FAULTS": fault}, check=False)
        assert killed.returncode == -signal.SIGKILL, f"{fault}: not killed at its fault point\n{killed.stderr[-3000:]}"
        said.append(killed.stdout)
        report = audit_run(RunStorage(str(root), "killed"))  # what a killed run committed audits clean
        assert report.ok, f"after {fault}:\n{report.text()}"
    resumed = run_unirl([*args, "--run-name", "killed"], unirl_env)
    said.append(resumed.stdout)
    # After the kill at sync@1 the update of iterations 0 and 1 exists in storage only: rebuilt from both batches.
    assert "replaying the train step of iter-000001 (one update on the batches of iter-000000 .. iter-000001)" in said[3]
    done = [line.split()[1] for out in said for line in out.splitlines() if line.startswith("[unirl] iter-")]
    assert done == [f"iter-{i:06d}" for i in range(4)], said  # each iteration committed (and reported) once
    a, b = (faults.snapshot(root / name, unirl_env, 4, version=2) for name in ("killed", "ref"))
    assert faults.differences(a, b) == []
    for name in ("killed", "ref"):
        run = root / name
        assert sorted(p.name for p in (run / "weights").iterdir()) == ["v000000", "v000002"]
        assert json.loads((run / "checkpoints/000002/extra.json").read_text())["worker"]["opt_steps"] == 2
        trained = [json.loads((run / f"iter-{i:06d}/train.json").read_text()) for i in range(4)]
        assert [(t["update"], t["policy_version"], t["window"]) for t in trained] == [
            (False, 0, [0, 1]), (True, 1, [0, 1]), (False, 1, [2, 3]), (True, 2, [2, 3])]
        assert [t["metrics"]["accumulated_batches"] for t in trained] == [1, 2, 1, 2]
        assert trained[1]["metrics"]["grad_norm"] > 0 and trained[3]["metrics"]["grad_norm"] > 0
        report = audit_run(RunStorage(str(root), name))
        assert report.ok and report.committed == [0, 1, 2, 3], report.text()
        assert [line.versions for line in report.lines] == [(0, 0), (0, 0), (1, 1), (1, 1)]

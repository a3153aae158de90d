"""How many CPU threads each rank of a worker group takes."""
from __future__ import annotations

import os

import pytest

from unirl.stages.workers.group import first_failure, threads_per_rank


def test_ranks_split_the_cores_and_obey_a_user_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == 8 and threads_per_rank(2) == 4 and threads_per_rank(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. two runs sharing the machine
    assert threads_per_rank(1) == 1 and threads_per_rank(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "32")  # never more than the cores
    assert threads_per_rank(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads_per_rank(2) == 4


def test_a_group_that_is_not_ready_in_time_is_killed_and_the_timeout_reported(tmp_path) -> None:
    """start() past `train.startup_timeout_s`: the error says so (not a refused connection to a
    control port that never opened) and no torchrun process is left behind."""
    from pathlib import Path

    from unirl.stages.recipe import load_recipe
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.group import WorkerGroup, WorkerGroupDied

    recipe = load_recipe(Path(__file__).parents[3] / "recipes" / "ar" / "tiny.yaml",
                         ["sft=null", f"storage.root={tmp_path}", "train.startup_timeout_s=0.2"])
    group = WorkerGroup(recipe, RunStorage(str(tmp_path), "slow"), init_weights="weights/v000000", log=lambda _: None)
    with pytest.raises(WorkerGroupDied, match="not ready after 0.2s"):
        group.start(None)
    assert group.proc is None and not group.alive()


REPORT = """unirl.stages.workers FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_07:53:44
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 17220)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 17220
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_07:53:44
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 17221)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 17221
=======================================================
"""


def test_the_rank_named_is_torchruns_root_cause_not_the_ranks_it_stopped_after() -> None:
    assert first_failure(REPORT) == "rank 1 (local rank 1, pid 17221) exited with signal SIGKILL"
    assert first_failure("no report here") == ""


def test_a_sigkilled_rank_is_named_before_a_peer_that_raised_in_the_same_second() -> None:
    """Rank 1 SIGKILLed, rank 0 raising on the broken collective, both seen in one pass: torchrun
    stamps them to the second, ties go to the lower rank, and its root cause is rank 0's exit 1.
    An earlier report in the same log (a group before) does not count."""
    earlier = REPORT.replace("17221", "100").replace("rank      : 1 (local_rank: 1)", "rank      : 3 (local_rank: 1)")
    tie = REPORT.replace("  exitcode  : -15 (pid: 17220)  (SIGTERM)", "  exitcode  : -9 (pid: 17222)  (SIGKILL)") \
        .replace("rank      : 0 (local_rank: 0)", "rank      : 1 (local_rank: 1)") \
        .replace("  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 17221)  (SIGKILL)",
                 "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 17221)")
    assert "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-01_07:53:44\n  host      : localhost\n  rank      : 0" in tie
    assert first_failure(earlier + tie) == "rank 1 (local rank 1, pid 17222) exited with signal SIGKILL"
    assert first_failure(earlier + REPORT.replace("-9 (pid: 17221)  (SIGKILL)", "1 (pid: 17221)")) == \
        "rank 1 (local rank 1, pid 17221) exited with exit code 1"  # no SIGKILL: the root cause, whoever it is


def test_a_child_spawned_from_a_thread_that_ends_lives_on_and_dies_with_the_process() -> None:
    """Groups, engines and producers are started from whatever thread needs them first (an
    iteration's flow run started ahead has its own): PR_SET_PDEATHSIG fires when the forking
    *thread* ends, so `spawn` forks from one thread that lives as long as the process. A rollout
    engine started in iteration 0 used to be SIGKILLed as iteration 0's thread finished."""
    import subprocess
    import sys
    import threading
    import time

    import psutil

    from tests.conftest import REPO
    from unirl.stages.runtime.processes import spawn

    code = ("import subprocess, sys, threading, time\n"
            "from unirl.stages.runtime.processes import spawn\n"
            "box = []\n"
            "t = threading.Thread(target=lambda: box.append(spawn([sys.executable, '-c', 'import time; time.sleep(60)'])))\n"
            "t.start(); t.join(); time.sleep(1.0)\n"
            "print(box[0].pid, box[0].poll(), flush=True)\n"
            "time.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert owner.stdout is not None
        pid, status = owner.stdout.readline().split()
        assert status == "None", "the child died with the thread that started it"
        child = psutil.Process(int(pid))
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (child.is_running() and child.status() != psutil.STATUS_ZOMBIE), "the child outlived its process"
    finally:
        owner.kill()
    # In this process too: a thread's spawn returns a running child.
    box: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: box.append(spawn([sys.executable, "-c", "import time; time.sleep(60)"])))
    t.start()
    t.join()
    time.sleep(0.5)
    try:
        assert box[0].poll() is None
    finally:
        box[0].kill()
        box[0].wait(timeout=10)

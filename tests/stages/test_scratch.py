"""Scratch folders in the temp dir do not outlive their process: removed at exit, and after a
SIGKILL by the next process that makes one (issue 40: every run left a copy of its weights)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.conftest import REPO

MAKE = ("import sys, time; from pathlib import Path; from unirl.stages.runtime.scratch import scratch_dir; "
        "d = scratch_dir('unirl-t-', Path(sys.argv[2]) if sys.argv[2:] else None); (d / 'weights.bin').write_bytes(b'x' * 1000); "
        "print(d, flush=True); time.sleep(float(sys.argv[1]))")


def _start(tmp_path, sleep: float, parent=None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKE, str(sleep), *([str(parent)] if parent else [])], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_scratch_folder_is_removed_when_its_process_exits(tmp_path):
    proc, folder = _start(tmp_path, 0)
    assert folder.startswith(str(tmp_path / "unirl-t-"))
    assert proc.wait(timeout=60) == 0
    assert not os.path.exists(folder)


def test_a_killed_process_leaves_its_folder_to_the_next_one_which_removes_it(tmp_path):
    proc, folder = _start(tmp_path, 60)
    alive, alive_folder = _start(tmp_path, 60)  # a living owner's folder is never touched
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert os.path.exists(f"{folder}/weights.bin")  # SIGKILL runs no exit handler
        other = tmp_path / "unirl-someone-else"  # a folder not made by unirl's scratch_dir is not ours
        other.mkdir()
        nxt, next_folder = _start(tmp_path, 0)
        assert nxt.wait(timeout=60) == 0
        assert not os.path.exists(folder) and not os.path.exists(next_folder)
        assert os.path.exists(f"{alive_folder}/weights.bin") and other.exists()
    finally:
        alive.kill()
        proc.kill()


def test_a_forked_child_does_not_remove_its_parents_folders(tmp_path):
    code = ("import os, sys; from unirl.stages.runtime.scratch import scratch_dir; d = scratch_dir('unirl-t-')\n"
            "if os.fork() == 0: sys.exit(0)  # the child's exit handlers run\n"
            "os.wait(); print(d.exists())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
    assert not any(tmp_path.iterdir())


def test_weights_staged_in_shared_memory_by_a_killed_run_are_removed_by_the_next(tmp_path):
    """Staged weights (stages/train/staging.py) live in /dev/shm, in RAM: a SIGKILLed run's copy is
    removed by the next process that makes a folder there (here a stand-in for /dev/shm)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    proc, folder = _start(tmp_path, 60, shm)
    try:
        assert folder.startswith(str(shm / "unirl-t-"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert os.path.exists(f"{folder}/weights.bin")
        nxt, _ = _start(tmp_path, 0, shm)
        assert nxt.wait(timeout=60) == 0
        assert not os.path.exists(folder) and not any(shm.iterdir())
    finally:
        proc.kill()

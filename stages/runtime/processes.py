"""Local processes of a worker group: how many threads each rank takes, launching so that a
child dies with its parent (`spawn`), ending a whole torchrun tree, and reading torchrun's failure report."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Limits:
    """What one sandboxed tool server (stages/tools/sandbox.py) (all its processes together, where the kernel counts per process: each)
    may use."""

    cpu_s: int = 300
    memory_mb: int = 2048
    files: int = 256
    procs: int = 64


LAUNCHER_ENV = "UNIRL_LAUNCHER"
LAUNCHER_MODULE = "unirl_launcher"


def launcher() -> ModuleType | None:
    """The launch hook: the Python file named by UNIRL_LAUNCHER (loaded once per process as module
    `unirl_launcher`), or None, when unirl's processes start as fresh interpreters. The file gives
    `launch(cmd, **popen_kwargs)`, a `subprocess.Popen`-like handle or None to start `cmd` as usual;
    `rank_entry(args)`, what torchrun runs as each rank; `parent_pid()`, the process that asked for
    this one. Only the test suite sets it (docs/contributing.md)."""
    path = os.environ.get(LAUNCHER_ENV)
    if not path:
        return None
    module = sys.modules.get(LAUNCHER_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(LAUNCHER_MODULE, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{LAUNCHER_ENV}={path}: not a Python file; unset it to start processes as usual")
        module = importlib.util.module_from_spec(spec)
        sys.modules[LAUNCHER_MODULE] = module
        spec.loader.exec_module(module)
    return module


def rank_entry(args: list[str]) -> list[str]:
    """What torchrun runs as each rank (after its own options): `-m unirl.stages.workers ARGS`."""
    hook = launcher()
    return hook.rank_entry(args) if hook is not None else ["-m", "unirl.stages.workers", *args]


def parent_pid() -> int:
    """The process that started this one (a rank's: torchrun's agent)."""
    hook = launcher()
    return hook.parent_pid() if hook is not None else os.getppid()


def threads_per_rank(nproc: int) -> int:
    """CPU threads of each rank: the cores split between the ranks, or at most `OMP_NUM_THREADS`
    when the user set it (two runs sharing a machine each take their share; more threads than
    cores makes CPU kernels many times slower)."""
    share = max(1, (os.cpu_count() or 1) // nproc)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share


FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


def first_failure(log: str) -> str:
    """`rank R (local rank L, pid P) exited with <signal or code>` for the first failure of torchrun's
    last report in `log` ('' when it has none): its root cause, unless another rank of the same
    report was SIGKILLed. torchrun stamps failures to the second and breaks ties by rank, so a
    rank the OOM killer or `kill -9` ended and a lower rank that then raised on the broken
    collective, noticed in one pass, would name the lower rank; SIGKILL is never torchrun's own
    way of stopping a rank (it sends SIGTERM), so that rank is the cause."""
    root = log.rfind("Root Cause")  # the report lists the other ranks' failures first
    if root < 0:
        return ""
    report = log[log.rfind("FAILED", 0, root) + 1:]
    failures = [m.groups() for m in FAILURE.finditer(report)]
    cause = FAILURE.search(log, root)
    if cause is None:
        return ""
    killed = [f for f in failures if int(f[2]) == -signal.SIGKILL]
    rank, local, code, pid = killed[0] if killed and int(cause.group(3)) != -signal.SIGKILL else cause.groups()
    code_i = int(code)
    how = f"signal {signal.Signals(-code_i).name}" if code_i < 0 and -code_i in signal.valid_signals() else f"exit code {code_i}"
    return f"rank {rank} (local rank {local}, pid {pid}) exited with {how}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies (PR_SET_PDEATHSIG), so no child is orphaned. The
    parent is the *thread* that forked this process: start children with `spawn`."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kwargs)` in a new session, dying with this process (`die_with_parent`),
    forked from one thread that lives as long as this process. Linux sends PR_SET_PDEATHSIG's
    signal when the thread that forked a child ends, not its process: a worker group, rollout
    engine or producer forked from a short-lived thread (an iteration's flow run started ahead, a
    Prefect task's thread) would be SIGKILLed the moment that thread finished. A launch hook
    (`launcher`) may start it instead."""
    hook = launcher()
    if hook is not None:
        proc = hook.launch(cmd, start_new_session=True, **kwargs)
        if proc is not None:
            return proc
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unirl-spawner")
    return _spawner.submit(lambda: subprocess.Popen(cmd, preexec_fn=die_with_parent, start_new_session=True, **kwargs)).result()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the torchrun agent and every rank (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass

"""Fault injection, for the fault table (benchmarks/faults.py) and its tests: the variable
UNIRL_FAULTS names points where the run is killed with SIGKILL — no cleanup, no `finally`, as the
OOM killer or `kill -9` would — the moment it reaches them:

    UNIRL_FAULTS=train@1        inside iteration 1's train stage: its work done, its output not committed
    UNIRL_FAULTS=checkpoint     while a checkpoint is being written (in a worker rank)
    UNIRL_FAULTS=sft            in the middle of SFT
    UNIRL_FAULTS=report@1       iteration 1 committed (`_SUCCESS`), its MLflow report not yet made
    UNIRL_FAULTS=train-rank1@1  worker rank 1 alone, as iteration 1's update starts (the rank dies, not unirl)
    UNIRL_FAULTS=train-node@1   every rank of a node, its torchrun agent and the `unirl agent` around it, as
                                iteration 1's update starts: the node is lost (set it on that node only)
    UNIRL_FAULTS=sync@1:stop    the process that reaches the point stops itself (SIGSTOP), as a hung process
                                would, and waits there for whoever kills it: a test's own SIGKILL then lands
                                at that point for certain, not wherever a poll happened to see a file

With UNIRL_FAULTS_ONCE=FILE a fault fires only where FILE does not exist yet (it is created as the
fault fires): a retried task or a relaunched group then gets through.

Points: requests, generate, score, advantage, train, sync (checkpoint + publish), checkpoint,
evaluate, sft, report; produce (the async producer's batch), engine-generate (inside a rollout engine
process, as it samples: the engine dies, not unirl). A point in a worker rank kills the `unirl` process that owns the group
(UNIRL_OWNER_PID) and then the rank. Unset (always, outside these tests), a point costs one dict
lookup.
"""
from __future__ import annotations

import os
import signal
import threading

POINTS = ("requests", "generate", "score", "advantage", "train", "sync", "checkpoint", "evaluate", "sft", "report",
          "produce", "engine-generate")


def fault_point(point: str, iteration: int | None = None, *, owner: bool = True, node: bool = False) -> None:
    """SIGKILL here if UNIRL_FAULTS names `point` (at `iteration`); `owner`: the `unirl` process
    that owns this worker group dies too (a run killed inside a stage), else only this process;
    `node`: this worker rank's node agent (UNIRL_NODE_WRAPPER_PID) and torchrun agent first."""
    spec = os.environ.get("UNIRL_FAULTS")
    if not spec:
        return
    for item in spec.split(","):
        item, _, mode = item.strip().partition(":")
        name, _, at = item.partition("@")
        if name == point and (not at or iteration is None or int(at) == iteration):
            if not _first_time():
                return
            if mode == "stop":
                # To this thread, not the process: a process-directed SIGSTOP may be taken by another
                # thread, and until that thread runs, this one went on (a loaded machine saw the
                # stage's manifest committed by a run "stopped" before it). SIGSTOP stops every thread.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
                return
            pid = int(os.environ.get("UNIRL_OWNER_PID", "0") or 0) if owner else 0
            if pid and pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
            if node:
                # start-up time: loaded on first use
                from unirl.stages.runtime.processes import parent_pid  # torchrun's agent

                for holder in (int(os.environ.get("UNIRL_NODE_WRAPPER_PID", "0") or 0), parent_pid()):
                    if holder > 1:
                        os.kill(holder, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _first_time() -> bool:
    """False when UNIRL_FAULTS_ONCE names a file that exists (the fault fired already); else
    creates it and says True."""
    marker = os.environ.get("UNIRL_FAULTS_ONCE")
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False

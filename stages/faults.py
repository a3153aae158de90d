"""Fault injection, for the fault table (benchmarks/faults.py) and its tests: the variable
UNIRL_FAULTS names points where the run is killed with SIGKILL — no cleanup, no `finally`, as the
OOM killer or `kill -9` would — the moment it reaches them:

    UNIRL_FAULTS=train@1        inside iteration 1's train stage: its work done, its output not committed
    UNIRL_FAULTS=checkpoint     while a checkpoint is being written (in a worker rank)
    UNIRL_FAULTS=sft            in the middle of SFT
    UNIRL_FAULTS=train-rank1@1  worker rank 1 alone, as iteration 1's update starts (the rank dies, not unirl)

Points: requests, generate, score, advantage, train, sync (checkpoint + publish), checkpoint,
evaluate, sft; produce (the async producer's batch), engine-generate (inside a rollout engine
process, as it samples: the engine dies, not unirl). A point in a worker rank kills the `unirl` process that owns the group
(UNIRL_OWNER_PID) and then the rank. Unset (always, outside these tests), a point costs one dict
lookup.
"""
from __future__ import annotations

import os
import signal

POINTS = ("requests", "generate", "score", "advantage", "train", "sync", "checkpoint", "evaluate", "sft", "produce",
          "engine-generate")


def fault_point(point: str, iteration: int | None = None, *, owner: bool = True) -> None:
    """SIGKILL here if UNIRL_FAULTS names `point` (at `iteration`); `owner`: the `unirl` process
    that owns this worker group dies too (a run killed inside a stage), else only this process."""
    spec = os.environ.get("UNIRL_FAULTS")
    if not spec:
        return
    for item in spec.split(","):
        name, _, at = item.strip().partition("@")
        if name == point and (not at or iteration is None or int(at) == iteration):
            pid = int(os.environ.get("UNIRL_OWNER_PID", "0") or 0) if owner else 0
            if pid and pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

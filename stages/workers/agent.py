"""One node of a run's worker group: its torchrun agent, started by `unirl agent` or by the
`node-agent` Prefect flow (flows/nodes.py) on each host other than the flow's.

The agent joins the run's newest group announced in run storage (or the one it is told), runs
`torchrun <the group's rendezvous> -m unirl.stages.workers` with this node's ranks, streams torchrun's
output, and leaves its record in the group: joined, then its exit code and the failure torchrun
named. A group that never forms, or that the flow has given up on, ends it.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from unirl.stages.models.family import get_family
from unirl.stages.runtime.processes import rank_entry
from unirl.stages.runtime.scratch import scratch_dir
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers import rendezvous as rdzv
from unirl.stages.workers.group import first_failure, kill_tree, spawn, threads_per_rank


def open_group(storage: RunStorage, timeout_s: float, shared_mount: bool = False) -> str:
    """The run's newest group that has not started yet (waiting for the flow to announce one).
    `shared_mount`: the recipe says its local root is one filesystem on every node
    (`storage.shared`), which is the first thing to doubt when nothing is announced."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = storage.read_json(rdzv.CURRENT) if storage.exists(rdzv.CURRENT) else None
        if current is not None and not _closed(storage, current["group"]):
            return current["group"]
        if time.monotonic() > deadline:
            raise rdzv.NodeSetupError(
                f"no worker group of run {storage.run!r} to join at {storage.url()} within {timeout_s:.0f}s: start (or "
                "rerun) the run, whose group announces itself there, and check that this node reads the same storage"
                + (f" (storage.shared is set: {storage.url()} must be the same mounted filesystem here as on the run's "
                   "host, not a local folder of the same name)" if shared_mount and storage.local else ""))
        time.sleep(1.0)


def _closed(storage: RunStorage, group: str) -> bool:
    return storage.exists(rdzv.group_rel(group, "ready.json")) or storage.exists(rdzv.group_rel(group, "stopped.json"))


def serve_node(storage: RunStorage, recipe: Any, *, group: str = "", log: Callable[[str], None] = print) -> int:
    """Run this node's agent for one group of the run; returns torchrun's exit code (0: the group
    was shut down cleanly). Raises NodeSetupError, saying what to fix, before anything starts when
    the group cannot be joined."""
    if recipe.train.nnodes == 1:
        raise rdzv.NodeSetupError("train.nnodes is 1: the run's own host is its only node, there is no group to join "
                                  "from here (set train.nnodes to the number of nodes)")
    group = group or open_group(storage, recipe.train.startup_timeout_s, recipe.storage.shared)
    plan = rdzv.read_plan(storage, group)
    if plan.fingerprint != recipe.fingerprint():
        raise rdzv.NodeSetupError(f"group {group} of run {storage.run!r} was started with another recipe than this "
                                  "agent's; give the agent the run's recipe")
    if _closed(storage, group):
        raise rdzv.NodeSetupError(f"group {group} of run {storage.run!r} has already started (or was stopped); an agent "
                                  "joins a group before it starts: rerun the run and start the agent for its new group")
    token = rdzv.group_token(rdzv.control_secret(plan.nnodes), group)
    threads = threads_per_rank(plan.nproc_per_node)
    scratch = scratch_dir(f"unirl-{storage.run}-node-")
    pointer = scratch / "node.json"
    pointer.write_text(json.dumps(rdzv.node_pointer(storage, plan, scratch, threads)))

    cmd = [sys.executable, "-m", "torch.distributed.run", *plan.torchrun_args(),
           *rank_entry(["--spec", str(pointer), "--preload", ",".join(get_family(recipe.model.kind).modules)])]
    env = {**os.environ, "UNIRL_CONTROL_TOKEN": token, "OMP_NUM_THREADS": str(threads), "UNIRL_NODE_WRAPPER_PID": str(os.getpid())}
    log(f"[unirl] node agent for run {storage.run}, group {group}: {plan.nproc_per_node} rank(s), rendezvous "
        f"{plan.endpoint} (id {plan.rdzv_id})")
    proc = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                 text=True, errors="replace")
    rdzv.write_agent(storage, group, proc.pid, state="joining")
    tail: collections.deque[str] = collections.deque(maxlen=200)
    reader = threading.Thread(target=_stream, args=(proc, tail, log), daemon=True)
    reader.start()
    try:
        _supervise(storage, group, proc)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    reader.join(timeout=5)
    code = proc.returncode
    failure = first_failure("\n".join(tail)) or _agent_death(storage, group, proc.pid, code)
    rdzv.write_agent(storage, group, proc.pid, state="exited", exit_code=code, failure=failure)
    if code:
        log(f"[unirl] node agent: torchrun exited with {code}{': ' + failure if failure else ''}")
    return code


def _stream(proc: subprocess.Popen, tail: collections.deque, log: Callable[[str], None]) -> None:
    assert proc.stdout is not None, "the agent's torchrun is started with stdout=PIPE"
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        log(line.rstrip("\n"))


def _supervise(storage: RunStorage, group: str, proc: subprocess.Popen) -> None:
    """Wait for torchrun; once the flow has stopped the group, give it 30 s to finish, then end it."""
    stopped_at = None
    while proc.poll() is None:
        time.sleep(2.0)
        if stopped_at is None and storage.exists(rdzv.group_rel(group, "stopped.json")):
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at > 30:
            kill_tree(proc)
    proc.wait()


def _agent_death(storage: RunStorage, group: str, pid: int, code: int | None) -> str:
    """When torchrun itself was killed (no report of its own): which of the group's ranks it held."""
    if code is None or code >= 0:
        return ""
    how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exit code {code}"
    ready = storage.read_json(rdzv.group_rel(group, "ready.json")) if storage.exists(rdzv.group_rel(group, "ready.json")) else {}
    mine = [f"rank {r['rank']} (local rank {r['local_rank']}, pid {r['pid']})" for r in ready.get("ranks", [])
            if int(r["agent_pid"]) == pid]
    return f"{', '.join(mine) or 'its ranks'}: the torchrun agent (pid {pid}) was ended by {how}"

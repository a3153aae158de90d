"""The client side of the worker group: launch `torchrun -m stages.workers` (one rank: the rank
process itself, without the agent), send it commands, notice when it died (naming the rank that
failed first), and bring it back at the right policy version.

A group lives across iterations (weights and optimizer load once). Relaunching restores the
latest committed checkpoint at or below the wanted version, then replays the train steps of the
iterations in between from their stored rollouts and advantages (deterministic on the same
world size), so a crash between checkpoints loses nothing and counts nothing twice.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stages.recipe import Recipe
from stages.storage import RunStorage, iter_dir, join
from stages.workers.control import recv_json, send_json


class WorkerError(RuntimeError):
    """A command failed inside the worker group (the message carries the remote traceback)."""


def threads_per_rank(nproc: int) -> int:
    """CPU threads of each rank: the cores split between the ranks, or at most `OMP_NUM_THREADS`
    when the user set it (two runs sharing a machine each take their share; more threads than
    cores makes CPU kernels many times slower)."""
    share = max(1, (os.cpu_count() or 1) // nproc)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share


class WorkerGroupDied(WorkerError):
    """The worker group's processes exited; the message names the rank that died first (as
    torchrun reports it) and carries the end of the group's log."""


def first_failure(log: str) -> str:
    """`rank R (local rank L, pid P) exited with <signal or code>` from torchrun's report of the
    first failure in `log` ('' when it has none)."""
    import re

    root = log.rfind("Root Cause")  # the report lists the other ranks' failures first
    m = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)",
                  log[root:] if root >= 0 else log)
    if m is None:
        return ""
    rank, local, code, pid = m.groups()
    code_i = int(code)
    how = f"signal {signal.Signals(-code_i).name}" if code_i < 0 and -code_i in signal.valid_signals() else f"exit code {code_i}"
    return f"rank {rank} (local rank {local}, pid {pid}) exited with {how}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    def __init__(self, recipe: Recipe, storage: RunStorage, *, init_weights: str, log: Callable[[str], None] = print,
                 mode: str = "rl"):
        self.recipe = recipe
        self.mode = mode
        self.storage = storage
        self.init_weights = init_weights
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.version: int | None = None
        self.token = secrets.token_hex(16)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"unirl-{storage.run}-"))
        self.log_path = self.scratch / "workers.log"
        self._threads = threads_per_rank(recipe.train.nproc)
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def prewarm(self) -> None:
        """Launch the group's processes now, before there is anything to load: they import torch
        and the model code (seconds on a small machine) while the run is still being set up, and
        wait for `start` to say what to load. A group that is already running is left alone."""
        if self.alive():
            return
        self.stop()
        t = self.recipe.train
        for path in (self.scratch / "spec.json", self.scratch / "ready.json"):
            path.unlink(missing_ok=True)
        threads = threads_per_rank(t.nproc)
        env = {**os.environ, "UNIRL_CONTROL_TOKEN": self.token, "OMP_NUM_THREADS": str(threads),
               "UNIRL_OWNER_PID": str(os.getpid())}
        spec_path = self.scratch / "spec.json"
        from stages.models.family import get_family

        preload = ["--preload", ",".join(get_family(self.recipe.model.kind).modules)]
        if t.nproc == 1:
            # One rank needs no torchrun agent (an extra interpreter importing torch, ~2 s a start):
            # the rank itself, with the rendezvous variables torchrun would set.
            cmd = [sys.executable, "-m", "stages.workers", "--spec", str(spec_path), *preload]
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(t.nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
                "-m", "stages.workers", "--spec", str(spec_path), *preload,
            ]
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent, start_new_session=True,
        )
        logf.close()
        self._threads = threads
        _LIVE.add(self)

    def start(self, checkpoint: int | None) -> None:
        """Load `checkpoint` (a committed version) or the initial weights into the group: the
        prewarmed processes when they are waiting, else newly launched ones."""
        waiting = self.alive() and self.port is None and not (self.scratch / "spec.json").exists()
        if not waiting:
            self.stop()
            self.prewarm()
        t = self.recipe.train
        ready = self.scratch / "ready.json"
        spec = {
            "recipe": self.recipe.model_dump(mode="json"), "root": self.storage.root, "run": self.storage.run,
            "options": self.storage.options, "init_weights": self.init_weights, "init_version": 0,
            "checkpoint": checkpoint, "backend": t.backend, "ready_file": str(ready),
            "scratch": str(self.scratch), "threads_per_rank": self._threads, "mode": self.mode,
        }
        spec_path = self.scratch / "spec.json"
        tmp = spec_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(spec_path)  # the ranks wait for this file to appear whole
        what = f"checkpoint {checkpoint}" if checkpoint is not None else "initial weights"
        self.log(f"starting worker group: {t.nproc} rank(s), {what}")
        deadline = time.monotonic() + t.startup_timeout_s
        while not ready.exists():
            if not self.alive():
                raise WorkerGroupDied(f"worker group exited while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerGroupDied(f"worker group not ready after {t.startup_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.version = info["port"], info["version"]

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.alive() and self.port is not None:  # a group that never became ready has no control port
            try:
                self._send("shutdown", {}, timeout=timeout)
            except (WorkerError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.proc)
        self.proc = None
        self.port = None
        self.version = None
        _LIVE.discard(self)

    def died(self, when: str) -> WorkerGroupDied:
        """The error for a group found dead `when`, naming the rank that failed first."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)  # torchrun writes its failure report on the way out
            except subprocess.TimeoutExpired:
                pass
        tail = self.log_tail(80)
        who = first_failure(tail)
        code = self.proc.returncode if self.proc is not None else None
        if not who and self.recipe.train.nproc == 1 and code is not None and code != 0:  # no agent: the rank is the process
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
            who = f"rank 0 (pid {self.proc.pid}) exited with {how}"
        head = f"worker {who} {when}; the group is gone" if who else f"worker group died {when}"
        return WorkerGroupDied(f"{head} (rerun to resume from the last checkpoint):\n{tail}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    # -- commands ---------------------------------------------------------------------------
    def _send(self, cmd: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if not self.alive():
            raise WorkerGroupDied(f"worker group is not running:\n{self.log_tail()}")
        with self._lock, socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            send_json(sock, {"token": self.token, "cmd": cmd, "args": args})
            sock.settimeout(1.0)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    reply = recv_json(sock)
                    break
                except socket.timeout:
                    if not self.alive():
                        raise self.died(f"during {cmd!r}") from None
                    if deadline is not None and time.monotonic() > deadline:
                        raise WorkerError(f"{cmd!r} took longer than {timeout}s") from None
                except ConnectionError:
                    time.sleep(0.5)
                    raise self.died(f"(it closed the connection) during {cmd!r}") from None
        if not reply.get("ok"):
            if cmd != "shutdown":
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill_tree(self.proc)
                if first_failure(self.log_tail(80)):  # a peer rank died: its collective broke here
                    raise self.died(f"during {cmd!r}") from WorkerError(str(reply.get("error")))
            raise WorkerError(f"worker command {cmd!r} failed:\n{reply.get('error')}")
        return reply["result"]

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        result = self._send(cmd, args)
        if "policy_version" in result:
            self.version = result["policy_version"]
        elif "version" in result:
            self.version = result["version"]
        return result

    # -- bringing the group to a version ------------------------------------------------------
    def ensure(self, version: int) -> None:
        """Make the live group hold policy `version` (weights after `version` train steps)."""
        if self.alive() and self.version == version:
            return
        if not self.alive() or self.version is None or self.version > version:
            from stages.train.manifests import usable_checkpoint

            self.start(usable_checkpoint(self.storage, version, self.log))
        while self.version < version:
            self.replay(self.version)

    def replay(self, iteration: int) -> dict[str, Any]:
        """Redo iteration `iteration`'s train step from its committed rollouts and advantages."""
        rounds = sorted(
            (n[:-len(".json")] for n in self.storage.listdir(join(iter_dir(iteration), "manifests")) if n.startswith("generate")),
            key=lambda name: int(name.split("-r")[1]) if "-r" in name else 0,
        )
        gens = [self.storage.stage_manifest(iteration, name) for name in rounds]
        adv = self.storage.stage_manifest(iteration, "advantage")
        if not gens or adv is None:
            raise WorkerError(
                f"cannot rebuild policy version {iteration + 1}: {self.storage.url(iter_dir(iteration))} has no committed "
                "rollouts/advantages and no checkpoint covers it"
            )
        self.log(f"replaying the train step of {iter_dir(iteration)} from storage")
        rollouts = [f for gen in gens for f in gen["files"]]
        return self.call("train", iteration=iteration, rollouts=rollouts, advantages=adv["files"][0])


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent process dies (PR_SET_PDEATHSIG), so no child is orphaned."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


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


_LIVE: set[WorkerGroup] = set()
_GROUPS: dict[str, WorkerGroup] = {}


def get_group(key: str, factory: Callable[[], WorkerGroup]) -> WorkerGroup:
    """The process-wide group of a run (tasks of one flow run share it)."""
    group = _GROUPS.get(key)
    if group is None:
        group = _GROUPS[key] = factory()
    return group


def close_group(key: str) -> None:
    group = _GROUPS.pop(key, None)
    if group is not None:
        group.stop()


@atexit.register
def _stop_all() -> None:
    for group in list(_LIVE):
        try:
            kill_tree(group.proc) if group.proc else None
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass

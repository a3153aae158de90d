"""The client side of the worker group: launch `torchrun -m unirl.stages.workers` (one rank: the rank
process itself, without the agent), send it commands, notice when it died (naming the rank that
failed first, and at several nodes the node), and bring it back at the right policy version.

Several nodes (`train.nnodes`): this host's agent is one of them (`train.agents.flow_host`), the
others are started by `launch_nodes` (the run's Prefect deployment, tasks/common.py) or by hand
(`unirl agent`); the spec, rank 0's address and the ranks' last words go through run storage
(stages/workers/rendezvous.py).

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
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from unirl.stages.models.family import get_family
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.accumulation import closing_iteration, window
from unirl.stages.runtime.processes import die_with_parent, first_failure, free_port, kill_tree, rank_entry, spawn, threads_per_rank  # noqa: F401 (re-exported)
from unirl.stages.runtime.scratch import log_tail, scratch_dir
from unirl.stages.runtime.storage import RunStorage, committed_batch, iter_dir
from unirl.stages.train.manifests import usable_checkpoint
from unirl.stages.workers import rendezvous as rdzv
from unirl.stages.workers.control import recv_json, send_json


class WorkerError(RuntimeError):
    """A command failed inside the worker group (the message carries the remote traceback)."""


class WorkerGroupDied(WorkerError):
    """The worker group's processes exited; the message names the rank that died first (as
    torchrun reports it) and carries the end of the group's log. `kind`: `lost` (a node), `signal`
    (a rank killed), `error` (a rank raised), or "" when nothing says."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


# Starts the other nodes' agents of a new group: (plan, node indices) -> None.
NodeLauncher = Callable[["rdzv.GroupPlan", list[int]], None]


class ModelGroup(ABC):
    """A model in a worker group, at a policy version, as tasks use it: `call` a command, `ensure`
    a version (from the newest usable checkpoint, replaying the committed train steps after it).
    How commands reach the ranks and how the model (re)starts is the subclass's: its own
    processes (`WorkerGroup`), or a member of a group that holds several models (`MemberGroup`)."""

    def __init__(self, recipe: Recipe, storage: RunStorage, init_weights: str, log: Callable[[str], None]):
        self.recipe = recipe
        self.storage = storage
        self.init_weights = init_weights
        self.log = log
        self.version: int | None = None

    @abstractmethod
    def alive(self) -> bool:
        """The model's ranks are up and answer."""

    @abstractmethod
    def prewarm(self) -> None:
        """Start the processes ahead of the first load (their imports overlap the run's setup)."""

    @abstractmethod
    def start(self, checkpoint: int | None) -> None:
        """(Re)start the model at `checkpoint` (None: its initial weights); sets `version`."""

    @abstractmethod
    def stop(self, timeout: float = 20.0) -> None:
        """Stop the processes that hold the model."""

    @abstractmethod
    def log_tail(self, lines: int = 40) -> str:
        """The end of the group's log, for error messages."""

    @abstractmethod
    def _send(self, cmd: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send one command to rank 0 and return its result."""

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        result = self._send(cmd, args)
        if "policy_version" in result:
            self.version = result["policy_version"]
        elif "version" in result:
            self.version = result["version"]
        return result

    # -- bringing the group to a version ------------------------------------------------------
    def ensure(self, version: int) -> None:
        """Make the live group hold policy `version` (weights after `version` updates)."""
        if self.alive() and self.version == version:
            return
        if not self.alive() or self.version is None or self.version > version:
            self.start(usable_checkpoint(self.storage, version, self.log))
        assert self.version is not None, "a started group reports its version"
        while self.version < version:
            self.replay(self.version)

    def replay(self, version: int) -> dict[str, Any]:
        """Redo the update that made policy `version` + 1 from the committed rollouts and
        advantages of its iteration (with rollout accumulation, of every iteration of its window)."""
        last = closing_iteration(self.recipe, version + 1)
        batches = []
        for j in window(self.recipe, last):
            batch = committed_batch(self.storage, j)
            if batch is None:
                raise WorkerError(
                    f"cannot rebuild policy version {version + 1}: {self.storage.url(iter_dir(j))} has no committed "
                    "rollouts/advantages and no checkpoint covers it"
                )
            batches.append(batch)
        first = iter_dir(window(self.recipe, last)[0])
        self.log(f"replaying the train step of {iter_dir(last)}"
                 + (f" (one update on the batches of {first} .. {iter_dir(last)})" if len(batches) > 1 else "") + " from storage")
        earlier = {"earlier": batches[:-1]} if len(batches) > 1 else {}
        return self.call("train", iteration=last, rollouts=batches[-1]["rollouts"], advantages=batches[-1]["advantages"], **earlier)


class WorkerGroup(ModelGroup):
    """A model in its own worker group: a torchrun agent per node and its ranks, driven over a
    loopback socket (rank 0) with a per-group token."""

    def __init__(self, recipe: Recipe, storage: RunStorage, *, init_weights: str, log: Callable[[str], None] = print,
                 mode: str = "rl", launch_nodes: NodeLauncher | None = None):
        super().__init__(recipe, storage, init_weights, log)
        self.mode = mode
        self.launch_nodes = launch_nodes
        self.multinode = recipe.train.nnodes > 1
        self.plan: rdzv.GroupPlan | None = None  # several nodes: the group being started or running
        self.ready: dict[str, Any] | None = None  # rank 0's address and every rank's node, host, pid
        self.proc: subprocess.Popen | None = None  # this host's torchrun agent (or the one rank)
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.token = secrets.token_hex(16)
        self.scratch = scratch_dir(f"unirl-{storage.run}-")
        self.log_path = self.scratch / "workers.log"
        self._threads = threads_per_rank(recipe.train.nproc_per_node)
        self._lock = threading.Lock()
        self._checked = (0.0, False)  # (when, whether the group's records said it is failing)
        self._busy = False  # a command was sent and its reply never read (stop() then kills at once)

    # -- lifecycle --------------------------------------------------------------------------
    def alive(self) -> bool:
        """One node: the agent runs. Several: this host's agent (if any) runs, and no rank or agent
        has reported an error or an exit (read from storage at most every 2 s)."""
        if not self.multinode:
            return self.proc is not None and self.proc.poll() is None
        if self.plan is None or (self.proc is not None and self.proc.poll() is not None):
            return False
        when, bad = self._checked
        if time.monotonic() - when > 2.0:
            bad = rdzv.failing(self.storage, self.plan.group)
            self._checked = (time.monotonic(), bad)
        return not bad

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
        threads = threads_per_rank(t.nproc_per_node)
        env = {**os.environ, "UNIRL_CONTROL_TOKEN": self.token, "OMP_NUM_THREADS": str(threads),
               "UNIRL_OWNER_PID": str(os.getpid())}
        spec_path = self.scratch / "spec.json"
        preload = ["--preload", ",".join(self._preload())]
        self._threads = threads
        if self.multinode:
            self._prewarm_nodes(env, preload)
            return
        if t.nproc_per_node == 1:
            # One rank needs no torchrun agent (an extra interpreter importing torch, ~2 s a start):
            # the rank itself, with the rendezvous variables torchrun would set.
            cmd = [sys.executable, "-m", "unirl.stages.workers", "--spec", str(spec_path), *preload]
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(t.nproc_per_node),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
                *rank_entry(["--spec", str(spec_path), *preload]),
            ]
        self._launch(cmd, env)

    def _preload(self) -> list[str]:
        """Modules the ranks import while they wait for the spec: the model family's."""
        return list(get_family(self.recipe.model.kind).modules)

    def _launch(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        logf = open(self.log_path, "ab")
        self.proc = proc = spawn(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        logf.close()
        _LIVE.add(self)
        return proc

    def _prewarm_nodes(self, env: dict[str, str], preload: list[str]) -> None:
        """Several nodes: announce a new group in run storage, start this host's agent (when it is
        a node) and the other nodes' (`launch_nodes`). Each agent's ranks import while the
        rendezvous fills and the run sets up; they read the spec from storage once it is there."""
        t = self.recipe.train
        secret = rdzv.control_secret(t.nnodes)  # before anything starts: a missing secret is a setup error
        run_id = (self.storage.read_json("run.json") if self.storage.exists("run.json") else {}).get("run_id") or self.token
        self.plan = plan = rdzv.new_group(self.storage, self.recipe, run_id)
        self.token = rdzv.group_token(secret, plan.group)
        self._checked = (0.0, False)
        self.log_path = self.scratch / f"workers-{plan.group}.log"  # torchrun's report of this group only
        first = 0
        if t.agents.flow_host:
            first = 1
            pointer = self.scratch / "node.json"
            pointer.write_text(json.dumps(rdzv.node_pointer(self.storage, plan, self.scratch, self._threads)))
            cmd = [sys.executable, "-m", "torch.distributed.run", *plan.torchrun_args(),
                   *rank_entry(["--spec", str(pointer), *preload])]
            proc = self._launch(cmd, {**env, "UNIRL_CONTROL_TOKEN": self.token})
            rdzv.write_agent(self.storage, plan.group, proc.pid, state="joining")
        others = list(range(first, t.nnodes))
        if others and self.launch_nodes is not None:
            self.launch_nodes(plan, others)
        elif others:
            self.log(f"waiting for {len(others)} more node(s) at rendezvous {plan.endpoint}: start each with "
                     f"`unirl agent RECIPE --run-name {self.storage.run}` there")

    def start(self, checkpoint: int | None) -> None:
        """Load `checkpoint` (a committed version) or the initial weights into the group: the
        prewarmed processes when they are waiting, else newly launched ones."""
        self._busy = False
        self._boot(self._load(self.recipe, self.storage, self.init_weights, checkpoint),
                   f"checkpoint {checkpoint}" if checkpoint is not None else "initial weights")

    def _load(self, recipe: Recipe, storage: RunStorage, init_weights: str, checkpoint: int | None) -> dict[str, Any]:
        """What a Worker loads: a model's recipe, run storage, initial weights and checkpoint."""
        return {"recipe": recipe.model_dump(mode="json"), "root": storage.root, "run": storage.run,
                "options": storage.options, "init_weights": init_weights, "init_version": 0,
                "checkpoint": checkpoint, "mode": self.mode}

    def _boot(self, load: dict[str, Any], what: str) -> None:
        waiting = self.alive() and self.port is None and not (self.scratch / "spec.json").exists()
        if not waiting:
            self.stop()
            self.prewarm()
        t = self.recipe.train
        ready = self.scratch / "ready.json"
        spec = {"root": self.storage.root, "run": self.storage.run, "options": self.storage.options, **load,
                "backend": t.backend, "ready_file": str(ready), "scratch": str(self.scratch), "threads_per_rank": self._threads}
        spec_path = self.scratch / "spec.json"
        tmp = spec_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(spec_path)  # the ranks wait for this file to appear whole
        if self.multinode:
            plan = self._plan()
            self.storage.write_json(rdzv.group_rel(plan.group, "spec.json"), {**spec, "endpoint": plan.endpoint})
            nodes = f"{plan.min_nnodes}-{t.nnodes}" if plan.min_nnodes != t.nnodes else str(t.nnodes)
            self.log(f"starting worker group: {nodes} node(s) x {t.nproc_per_node} rank(s), {what}")
        else:
            self.log(f"starting worker group: {t.nproc_per_node} rank(s), {what}")
        deadline = time.monotonic() + t.startup_timeout_s
        while (info := self._ready(ready)) is None:
            if not self.alive():
                if self.multinode:
                    raise self.died("while starting")
                raise WorkerGroupDied(f"worker group exited while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                missing = self._waiting_for() if self.multinode else ""
                self.stop()
                raise WorkerGroupDied(f"worker group not ready after {t.startup_timeout_s}s{missing}:\n{self.log_tail()}")
            time.sleep(0.05 if not self.multinode else 0.25)
        self.ready = info
        self.host, self.port, self.version = info["host"], info["port"], info["version"]
        if self.multinode:
            hosts = sorted({r["host"] for r in info["ranks"]})
            self.log(f"worker group ready: {info['world_size']} rank(s) on {len({r['node'] for r in info['ranks']})} "
                     f"node(s) ({', '.join(hosts)}); rank 0 on {info['ranks'][0]['host']}, control at {self.host}:{self.port}")

    def _ready(self, local: Path) -> dict[str, Any] | None:
        if not self.multinode:
            return json.loads(local.read_text()) if local.exists() else None
        rel = rdzv.group_rel(self._plan().group, "ready.json")
        return self.storage.read_json(rel) if self.storage.exists(rel) else None

    def _waiting_for(self) -> str:
        """Why a group of several nodes did not form: how many agents joined the rendezvous."""
        plan = self._plan()
        joined = rdzv.agents(self.storage, plan.group)
        hosts = ", ".join(sorted(a["host"] for a in joined)) or "none"
        return (f": {len(joined)} of {plan.nnodes} node agent(s) joined rendezvous {plan.endpoint} "
                f"(id {plan.rdzv_id}; joined: {hosts}); every node must run its agent (train.agents) and reach "
                f"the endpoint and {self.storage.url()}")

    def _plan(self) -> rdzv.GroupPlan:
        assert self.plan is not None, "a group of several nodes has its plan from prewarm on"
        return self.plan

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None and self.plan is None:
            return
        # A command left without its reply (the run interrupted by SIGINT or SIGTERM, or failing, while
        # rank 0 works on a warm-up or an update) keeps the group busy: it would take the shutdown only
        # when done, and nothing it has not committed is worth waiting for.
        if self.alive() and self.port is not None and not self._busy:  # a group that never became ready has no control port
            try:
                self._send("shutdown", {}, timeout=timeout)
            except (WorkerError, OSError):
                pass
            try:
                if self.proc is not None:
                    self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            kill_tree(self.proc)
        if self.plan is not None:  # this host's agent's last record; agents still waiting for the group give up
            try:
                if self.proc is not None and self.recipe.train.agents.flow_host:
                    rdzv.write_agent(self.storage, self.plan.group, self.proc.pid, state="exited",
                                     exit_code=self.proc.returncode, failure=first_failure(self.log_tail(80)))
                self.storage.write_json(rdzv.group_rel(self.plan.group, "stopped.json"), {"group": self.plan.group})
            except Exception:  # noqa: BLE001 - the group is gone either way; waiting agents time out
                pass
        self.proc = None
        self.plan = None
        self.ready = None
        self.port = None
        self.version = None
        _LIVE.discard(self)

    def died(self, when: str) -> WorkerGroupDied:
        """The error for a group found dead `when`, naming the rank that failed first (and, at
        several nodes, its node; a lost node before the ranks that only saw it go)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)  # torchrun writes its failure report on the way out
            except subprocess.TimeoutExpired:
                pass
        tail = self.log_tail(80)
        who = first_failure(tail)
        kind = "signal" if "signal" in who else ""
        if self.multinode and self.plan is not None:
            kind, who = rdzv.name_failure(self.storage, self.plan.group, self.ready, (self.proc.pid, who) if self.proc else None)
        code = self.proc.returncode if self.proc is not None else None
        if not who and self.recipe.train.nproc_per_node == 1 and self.proc and code:  # no agent: the rank is the process
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
            who = f"rank 0 (pid {self.proc.pid}) exited with {how}"
        head = f"worker {who} {when}; the group is gone" if who else f"worker group died {when}"
        return WorkerGroupDied(f"{head} (rerun to resume from the last checkpoint):\n{tail}", kind)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    # -- commands ---------------------------------------------------------------------------
    def _send(self, cmd: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if not self.alive():
            raise WorkerGroupDied(f"worker group is not running:\n{self.log_tail()}")
        assert self.port is not None, "commands go to a group that is ready (it reported its control port)"
        with self._lock, socket.create_connection((self.host, self.port), timeout=30) as sock:
            self._busy = True
            send_json(sock, {"token": self.token, "cmd": cmd, "args": args})
            sock.settimeout(1.0)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    reply = recv_json(sock)
                    break
                except TimeoutError:
                    if not self.alive():
                        raise self.died(f"during {cmd!r}") from None
                    if deadline is not None and time.monotonic() > deadline:
                        raise WorkerError(f"{cmd!r} took longer than {timeout}s") from None
                except ConnectionError:
                    time.sleep(0.5)
                    raise self.died(f"(it closed the connection) during {cmd!r}") from None
            self._busy = False
        if not reply.get("ok"):
            if cmd != "shutdown" and self.multinode:
                died = self.died(f"during {cmd!r}")
                if died.kind != "error":  # a node or a rank is gone: this rank's collective broke with it
                    raise died from WorkerError(str(reply.get("error")))
            elif cmd != "shutdown":
                assert self.proc is not None, "a one-node group that answers has its process"
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill_tree(self.proc)
                if first_failure(self.log_tail(80)):  # a peer rank died: its collective broke here
                    raise self.died(f"during {cmd!r}") from WorkerError(str(reply.get("error")))
            raise WorkerError(f"worker command {cmd!r} failed:\n{reply.get('error')}")
        return reply["result"]

class SharedGroup(WorkerGroup):
    """One worker group holding several models (`pe.placement: shared`): its ranks hold each
    member's Worker (stages/workers/worker.py `Members`). Each member is used through its
    `MemberGroup`, which any task takes for a one-model group; (re)starting the group loads every
    member, the one that asked at its checkpoint, the others at their newest checkpoint at or
    below the version they held (then each replays what it lacks when next ensured).
    `storage`: the run that owns the group (its records and the spec's top-level run)."""

    def __init__(self, storage: RunStorage, members: dict[str, tuple[Recipe, RunStorage, str]], *,
                 log: Callable[[str], None] = print):
        first = next(iter(members.values()))[0]
        super().__init__(first, storage, init_weights="", log=log)
        self.members = {name: MemberGroup(self, name, *member) for name, member in members.items()}
        # `version` (rank 0's answer, kept up to date by the members): each member's version in the
        # live group, None when it is not running; `held`: each one's last known (kept when it dies)
        self.held: dict[str, int] = {}

    def _preload(self) -> list[str]:
        return sorted({m for member in self.members.values() for m in get_family(member.recipe.model.kind).modules})

    def restart(self, name: str, checkpoint: int | None, version: int) -> None:
        """(Re)start the group: member `name` at `checkpoint` (it wants `version`), every other at
        its usable checkpoint at or below the version it last held (or `version`, if it never ran)."""
        loads, said = {}, []
        for other, member in self.members.items():
            if other == name:
                at = checkpoint
            else:
                at = usable_checkpoint(member.storage, self.held.get(other, version), self.log)
            loads[other] = self._load(member.recipe, member.storage, member.init_weights, at)
            said.append(f"{other} at {'checkpoint ' + str(at) if at is not None else 'initial weights'}")
        self._boot({"members": loads}, f"members {', '.join(said)}")
        self.held.update(self.versions())

    def versions(self) -> dict[str, int]:
        """Rank 0's `version` of a shared group: each member's version."""
        assert isinstance(self.version, dict), "a shared group's ranks report each member's version"
        return cast("dict[str, int]", self.version)


class MemberGroup(ModelGroup):
    """One member of a SharedGroup, used as a one-model group: commands go to its Worker, its
    version is its own, and ensuring a version it cannot reach by replay restarts the whole group."""

    def __init__(self, shared: SharedGroup, name: str, recipe: Recipe, storage: RunStorage, init_weights: str):
        self.shared, self.name = shared, name
        super().__init__(recipe, storage, init_weights, shared.log)
        self._wanted = 0

    @property
    def version(self) -> int | None:
        return self.shared.versions().get(self.name) if self.alive() else None

    @version.setter
    def version(self, value: int | None) -> None:
        if value is not None:
            self.shared.versions()[self.name] = self.shared.held[self.name] = value

    def alive(self) -> bool:
        return self.shared.alive() and self.shared.port is not None

    def prewarm(self) -> None:
        self.shared.prewarm()

    def ensure(self, version: int) -> None:
        self._wanted = version
        super().ensure(version)

    def start(self, checkpoint: int | None) -> None:
        self.shared.restart(self.name, checkpoint, self._wanted)

    def stop(self, timeout: float = 20.0) -> None:
        self.shared.stop(timeout)

    def log_tail(self, lines: int = 40) -> str:
        return self.shared.log_tail(lines)

    def _send(self, cmd: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self.shared._send(cmd, {**args, "member": self.name}, timeout)


_LIVE: set[WorkerGroup] = set()
_GROUPS: dict[str, ModelGroup] = {}


def get_group(key: str, factory: Callable[[], ModelGroup]) -> ModelGroup:
    """The process-wide group of a run (tasks of one flow run share it)."""
    group = _GROUPS.get(key)
    if group is None:
        group = _GROUPS[key] = factory()
    return group


def share_group(groups: dict[str, ModelGroup]) -> None:
    """Make `groups` (key -> group, e.g. a SharedGroup's members by their runs' URLs) the
    process-wide groups of those keys, so every task of those runs uses them."""
    for key, group in groups.items():
        close_group(key)
        _GROUPS[key] = group


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

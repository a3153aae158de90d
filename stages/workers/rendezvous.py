"""Worker groups that span nodes: what the nodes share through run storage, and how a failure is
told apart from its echoes.

A group of `train.nnodes` nodes is one torchrun agent per node, all joining one c10d rendezvous
(its id: the run's and the group's). With c10d no node is known in advance to hold global rank 0,
so everything the nodes need is in the run folder, under `workers/<group>/`:

    workers/current.json            {"group": id} of the newest group (agents started by hand look here)
    workers/<group>/group.json      the plan: rendezvous endpoint and id, node and rank counts
    workers/<group>/spec.json       what the ranks load (written once the checkpoint is known)
    workers/<group>/ready.json      rank 0: where its control channel listens; every rank's node, host, pid
    workers/<group>/agents/<host>-<pid>.json   each agent that joined
    workers/<group>/ended/<host>-<pid>.json    ... and how it ended (exit code, torchrun's report)
    workers/<group>/exits/rank-<r>.json        each rank, on its way out: shut down, or its error
    workers/<group>/stopped.json    the flow is done with the group (waiting agents give up)

The control channel's token is never stored: every node derives it from the shared secret
($UNIRL_CONTROL_SECRET, a Kubernetes Secret or the hosts' environment) and the group id.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from unirl.stages.runtime.multinode import DEFAULT_RDZV_PORT, RDZV_ENV, SECRET_ENV
from unirl.stages.runtime.storage import RunStorage, join

CURRENT = "workers/current.json"
HOST_ENV = "UNIRL_CONTROL_HOST"  # the address rank 0 advertises (Kubernetes: the pod IP)
BIND_ENV = "UNIRL_CONTROL_BIND"  # the address it listens on (default: every interface)


class NodeSetupError(RuntimeError):
    """A multi-node group cannot start as configured (the message says what to set)."""


def group_rel(group: str, name: str = "") -> str:
    return join("workers", group, name) if name else join("workers", group)


def group_token(secret: str, group: str) -> str:
    """The control token of one group: HMAC-SHA256 of the group id under the shared secret, so a
    token seen once opens no other group and the secret itself never travels."""
    return hmac.new(secret.encode(), group.encode(), hashlib.sha256).hexdigest()


def control_secret(nnodes: int) -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise NodeSetupError(
            f"train.nnodes={nnodes}: set {SECRET_ENV} to the same secret on the flow's host and on every node (a "
            "Kubernetes Secret, a Prefect Secret block exported by the worker, or the hosts' environment); the "
            "control channel of each group is keyed by it")
    return secret


def rendezvous_endpoint(train: Any) -> str:
    """host:port of the rendezvous: the recipe's, else $UNIRL_RDZV_ENDPOINT (default port 29400)."""
    endpoint = train.rendezvous.endpoint or os.environ.get(RDZV_ENV, "")
    if not endpoint:
        raise NodeSetupError(f"train.nnodes={train.nnodes}: no rendezvous endpoint; set train.rendezvous.endpoint "
                             f"(host:port every node reaches, e.g. the first node:{DEFAULT_RDZV_PORT}) or ${RDZV_ENV}")
    return endpoint if ":" in endpoint else f"{endpoint}:{DEFAULT_RDZV_PORT}"


@dataclass
class GroupPlan:
    """What every node's agent needs to join one group."""

    group: str
    rdzv_id: str
    endpoint: str
    nnodes: int
    min_nnodes: int
    nproc_per_node: int
    last_call_s: float
    join_timeout_s: float
    fingerprint: str

    def torchrun_args(self) -> list[str]:
        """The agent's rendezvous options (`python -m torch.distributed.run ARGS -m unirl.stages.workers ...`).
        No restarts: a failed group is relaunched by the flow from its latest checkpoint."""
        nodes = str(self.nnodes) if self.min_nnodes == self.nnodes else f"{self.min_nnodes}:{self.nnodes}"
        return [
            "--nnodes", nodes, "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id, "--max-restarts", "0",
            "--rdzv-conf", f"join_timeout={int(self.join_timeout_s)},last_call_timeout={max(1, int(self.last_call_s))}",
        ]


def new_group(storage: RunStorage, recipe: Any, run_id: str) -> GroupPlan:
    """Plan a new group of the run and announce it (group.json, then current.json)."""
    t = recipe.train
    group = secrets.token_hex(6)
    plan = GroupPlan(group=group, rdzv_id=f"{run_id[:16]}-{group}", endpoint=rendezvous_endpoint(t), nnodes=t.nnodes,
                     min_nnodes=t.min_nnodes or t.nnodes, nproc_per_node=t.nproc_per_node,
                     last_call_s=t.rendezvous.last_call_s, join_timeout_s=t.startup_timeout_s,
                     fingerprint=recipe.fingerprint())
    storage.write_json(group_rel(group, "group.json"), asdict(plan))
    storage.write_json(CURRENT, {"group": group})
    return plan


def read_plan(storage: RunStorage, group: str) -> GroupPlan:
    return GroupPlan(**storage.read_json(group_rel(group, "group.json")))


def advertised_host(endpoint: str) -> str:
    """The address of this host that the flow can reach: $UNIRL_CONTROL_HOST, else the local address
    of the route toward the rendezvous endpoint (every node and the flow reach that network)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    host = endpoint.rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # UDP: chooses a route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def bind_address() -> str:
    return os.environ.get(BIND_ENV, "0.0.0.0")


def write_agent(storage: RunStorage, group: str, agent_pid: int, state: str, **fields: Any) -> None:
    """An agent's records: `joining` (in agents/), then `exited` (in ended/) with its torchrun exit
    code and the failure torchrun named (`first_failure`)."""
    host = socket.gethostname()
    folder = "agents" if state == "joining" else "ended"
    storage.write_json(group_rel(group, f"{folder}/{host}-{agent_pid}.json"), {"host": host, "pid": agent_pid, "state": state, **fields})


def agents(storage: RunStorage, group: str, folder: str = "agents") -> list[dict[str, Any]]:
    """The agents that joined (`agents`) or that ended (`ended`)."""
    return [storage.read_json(group_rel(group, f"{folder}/{n}")) for n in storage.listdir(group_rel(group, folder))]


def write_exit(storage: RunStorage, group: str, rank: int, status: str, error: str = "") -> None:
    """A rank's last word: `shutdown`, or `error` with the end of its traceback."""
    storage.write_json(group_rel(group, f"exits/rank-{rank:05d}.json"),
                       {"rank": rank, "status": status, "error": error[-2000:], "host": socket.gethostname(), "pid": os.getpid()})


def exits(storage: RunStorage, group: str) -> dict[int, dict[str, Any]]:
    out = {}
    for name in storage.listdir(group_rel(group, "exits")):
        record = storage.read_json(group_rel(group, f"exits/{name}"))
        out[int(record["rank"])] = record
    return out


def failing(storage: RunStorage, group: str) -> bool:
    """Whether a rank of a running group has left or an agent has ended: two listings, no reads
    (a group says goodbye only after the flow stopped asking)."""
    return bool(storage.listdir(group_rel(group, "exits")) or storage.listdir(group_rel(group, "ended")))


def name_failure(storage: RunStorage, group: str, ready: dict[str, Any] | None, local: tuple[int, str] | None,
                 wait_s: float = 10.0) -> tuple[str, str]:
    """(kind, message): which node or rank failed first, from the group's records. `lost`: a node
    none of whose ranks and whose agent left a word (its agent or its host died); `signal`: a rank
    ended by a signal, as its agent's torchrun reported it; `error`: the first rank that raised;
    "" when nothing says. `local`: (pid, torchrun's first failure) of the agent on the flow's
    host, whose report is in its log. Ranks that only saw a collective break are echoes, not causes."""
    nodes: dict[int, dict[str, Any]] = {}
    for r in (ready or {}).get("ranks", []):
        nodes.setdefault(int(r["node"]), {"host": r["host"], "agent_pid": int(r["agent_pid"]), "ranks": []})["ranks"].append(r)
    deadline = time.monotonic() + wait_s
    while True:
        gone = exits(storage, group)
        reports = {(a["host"], int(a["pid"])): a.get("failure", "") for a in agents(storage, group, "ended")}
        for n in nodes.values():
            if local is not None and n["agent_pid"] == local[0]:
                reports[(n["host"], n["agent_pid"])] = local[1]
        silent = [i for i, n in sorted(nodes.items()) if (n["host"], n["agent_pid"]) not in reports
                  and any(int(r["rank"]) not in gone for r in n["ranks"])]
        if not silent or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if silent:
        n = nodes[silent[0]]
        who = ", ".join(f"rank {r['rank']} (local rank {r['local_rank']}, pid {r['pid']})" for r in n["ranks"])
        return "lost", (f"node {silent[0]} (host {n['host']}, torchrun agent pid {n['agent_pid']}) was lost: {who} and "
                        f"its agent left no word within {wait_s:.0f}s (the agent or the host died)")
    for i, n in sorted(nodes.items()):
        failure = reports.get((n["host"], n["agent_pid"]), "")
        if "signal" in failure:
            return "signal", f"{failure} on node {i} (host {n['host']})"
    for rank, record in sorted(gone.items()):
        if record.get("status") == "error":
            last = [line for line in record.get("error", "").splitlines() if line.strip()][-1:] or ["(no message)"]
            return "error", f"rank {rank} (host {record['host']}, pid {record['pid']}) failed: {last[0][:300]}"
    return "", "; ".join(f for f in reports.values() if f)


def node_pointer(storage: RunStorage, plan: GroupPlan, scratch: Any, threads: int) -> dict[str, Any]:
    """What a node's ranks get as `--spec`: where the group's records are, and this node's own
    scratch folder and thread count (the rest of the spec comes from run storage)."""
    return {"root": storage.root, "run": storage.run, "options": storage.options, "group": plan.group,
            "scratch": str(scratch), "threads_per_rank": threads, "endpoint": plan.endpoint}

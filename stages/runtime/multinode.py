"""The recipe's multi-node sections (`train.rendezvous`, `train.agents`) and the rules a worker
group that spans nodes must meet, checked at `unirl validate` time (docs/deploy.md, "Several
nodes").

Every node runs one torchrun agent with `train.nproc_per_node` ranks; the agents join one c10d
rendezvous, so every node must reach the rendezvous endpoint and read the run folder: the spec
the ranks load, the initial weights, rollouts and checkpoints all move through run storage.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from unirl.stages.runtime.config_base import Section

DEFAULT_RDZV_PORT = 29400
RDZV_ENV = "UNIRL_RDZV_ENDPOINT"
SECRET_ENV = "UNIRL_CONTROL_SECRET"


class RendezvousConfig(Section):
    """torchrun's c10d rendezvous: every node's agent joins it; its id is the run's and the group's."""

    endpoint: str = Field(
        "", description=f"host:port of the c10d rendezvous store, reachable from every node (one of the nodes' agents "
        f"hosts it: the one on that host); empty: ${RDZV_ENV} on each node. Port {DEFAULT_RDZV_PORT} when omitted.")
    last_call_s: float = Field(
        30.0, gt=0, description="Elastic groups (train.min_nnodes): once min_nnodes agents joined, how long the "
        "rendezvous waits for more before it starts with those it has.")


class AgentsConfig(Section):
    """How the nodes' torchrun agents start (train.nnodes > 1)."""

    flow_host: bool = Field(
        True, description="The host that runs the flow is one of the nodes: it starts its own agent. false: the flow "
        "only sends commands (e.g. a CPU pod) and all train.nnodes agents start elsewhere.")
    deployment: str = Field(
        "", description="Prefect deployment (`node-agent/<name>`) the run starts once per other node, for every "
        "group it launches (a retried or resumed run starts them again). Empty: start them yourself with "
        "`unirl agent RECIPE --run-name NAME` (or `prefect deployment run`) on every other node.")
    work_queues: list[str] = Field(
        default_factory=list, description="With `deployment`: the work queue of each other node, in order (one "
        "process worker per host serves its own queue, so each agent lands on its own host). Empty: the deployment's.")


def is_shared_url(root: str) -> bool:
    """Whether a storage root is an object store every node reaches (not a path on this node)."""
    protocol = root.split("://", 1)[0] if "://" in root else ""
    return protocol not in ("", "file", "local", "memory")


def multinode_errors(recipe: Any) -> list[str]:
    """`field: message` for every rule a group of `train.nnodes` nodes breaks (empty at one node)."""
    t, s = recipe.train, recipe.storage
    errors: list[str] = []
    if t.min_nnodes is not None and t.min_nnodes > t.nnodes:
        errors.append(f"train.min_nnodes: {t.min_nnodes} is more than train.nnodes={t.nnodes}; the group runs on "
                      "min_nnodes to nnodes nodes")
    if t.nnodes == 1:
        if not t.agents.flow_host:
            errors.append("train.agents.flow_host: a one-node group runs on the flow's host; set train.nnodes > 1 to "
                          "run the group on other nodes")
        return errors
    where = f"with train.nnodes={t.nnodes} every node reads the run folder"
    if s.root.startswith("memory://"):
        errors.append(f"storage.root: memory:// lives in one process; {where}: use s3://bucket/prefix or a shared "
                      "filesystem (storage.shared=true)")
    elif not is_shared_url(s.root) and not s.shared:
        errors.append(f"storage.root: {s.root!r} is a path on this node; {where}: use s3://bucket/prefix, or a "
                      "filesystem mounted at the same path on every node (NFS, Lustre...) and set storage.shared=true")
    if t.rendezvous.endpoint:
        host, _, port = t.rendezvous.endpoint.rpartition(":") if ":" in t.rendezvous.endpoint else (t.rendezvous.endpoint, "", "")
        if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
            errors.append(f"train.rendezvous.endpoint: {t.rendezvous.endpoint!r} is not host:port (e.g. node-0.example:"
                          f"{DEFAULT_RDZV_PORT})")
    a = t.agents
    if a.deployment and a.deployment.count("/") != 1:
        errors.append(f"train.agents.deployment: {a.deployment!r} is not a deployment name `flow/deployment` "
                      "(e.g. node-agent/tiny-2node)")
    others = t.nnodes - (1 if a.flow_host else 0)
    if a.work_queues and len(a.work_queues) != others:
        errors.append(f"train.agents.work_queues: {len(a.work_queues)} queue(s) for {others} node(s) started by the "
                      "deployment; give one per node (or none)")
    if a.work_queues and not a.deployment:
        errors.append("train.agents.work_queues: only used with train.agents.deployment")
    return errors

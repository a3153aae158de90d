"""Kubernetes templates for multi-node runs (docs/deploy.md, "Several nodes on Kubernetes").

* `node_template`: the base job template of a Kubernetes work pool for `node-agent` flow runs:
  one pod per node (one flow run per node, the run starts them: tasks/common.py `node_launcher`),
  `gpus` nvidia.com/gpu requested and limited, the rendezvous endpoint through a headless
  Service (the pod with `node_index` 0 is behind it and hosts the c10d store), the control
  secret from a Secret, storage credentials from another (envFrom), the pod IP advertised as
  rank 0's control address.
* `flow_template`: the same Secrets for the `rl-train` flow-run pod (CPU is enough with
  `train.agents.flow_host: false`: it only sends commands).
* `rdzv_service`: the headless Service, one per concurrently running multi-node run.

Both job templates start from `prefect work-pool get-default-base-job-template --type kubernetes`.
"""
from __future__ import annotations

import copy
from typing import Any

from unirl.stages.runtime.multinode import DEFAULT_RDZV_PORT, RDZV_ENV, SECRET_ENV
from unirl.stages.workers.rendezvous import HOST_ENV

RDZV_LABEL = "unirl.dev/rdzv"
NODE_LABEL = "unirl.dev/node"


def _variable(kind: str, default: Any, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "default": default, "description": description, **extra}


def _secrets(template: dict[str, Any], control_secret: str, storage_secret: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`template` with the control secret and storage credentials wired into its container;
    returns (template, its pod spec)."""
    out = copy.deepcopy(template)
    props = out.setdefault("variables", {}).setdefault("properties", {})
    props["control_secret"] = _variable(
        "string", control_secret, f"Kubernetes Secret whose key {SECRET_ENV} is the run's control secret (the same for "
        "the flow and every node).")
    props["storage_secret"] = _variable(
        "string", storage_secret, "Kubernetes Secret whose keys become environment variables: the run storage's "
        "credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL ...).")
    manifest = out["job_configuration"]["job_manifest"]
    job_spec = manifest["spec"]
    pod = job_spec["template"]["spec"]
    # The default template puts the Job's completions/parallelism inside the pod spec, where the
    # Kubernetes API schema has no such fields: they belong to the Job.
    for key in ("completions", "parallelism"):
        job_spec[key] = pod.pop(key, 1)
    container = pod["containers"][0]
    # A list (not "{{ env }}"): the Prefect worker prepends the job variables' `env` to it.
    container["env"] = [
        {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": "{{ control_secret }}", "key": SECRET_ENV}}},
    ]
    container["envFrom"] = [{"secretRef": {"name": "{{ storage_secret }}"}}]
    return out, pod


def flow_template(template: dict[str, Any], control_secret: str = "unirl", storage_secret: str = "unirl-storage") -> dict[str, Any]:
    """The `rl-train` flow-run pod of a multi-node run: the control secret and storage credentials."""
    out, _ = _secrets(template, control_secret, storage_secret)
    return out


def node_template(template: dict[str, Any], gpus: int = 1, control_secret: str = "unirl",
                  storage_secret: str = "unirl-storage", rdzv_service: str = "unirl-rdzv") -> dict[str, Any]:
    """The `node-agent` pod: one per node of a run's worker group."""
    out, pod = _secrets(template, control_secret, storage_secret)
    props = out["variables"]["properties"]
    props["gpus"] = _variable("integer", gpus, "nvidia.com/gpu requested and limited per node pod: the recipe's "
                              "train.nproc_per_node.", minimum=0)
    props["node_index"] = _variable("integer", 0, "Which node of the run this pod is (set by the run for each node it "
                                    "starts); node 0 is behind the rendezvous Service and hosts the c10d store.", minimum=0)
    props["rdzv_service"] = _variable("string", rdzv_service, "The headless Service in front of node 0 (one per "
                                      "concurrently running multi-node run: `python -m unirl.flows.deploy k8s-rdzv-service`).")
    props["rdzv_port"] = _variable("integer", DEFAULT_RDZV_PORT, "Port of the c10d rendezvous store.")
    manifest = out["job_configuration"]["job_manifest"]
    labels = {RDZV_LABEL: "{{ rdzv_service }}", NODE_LABEL: "node-{{ node_index }}"}
    manifest["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    container = pod["containers"][0]
    container["env"] += [
        {"name": RDZV_ENV, "value": "{{ rdzv_service }}:{{ rdzv_port }}"},
        # rank 0 may land on any node: it advertises its pod's IP, which the flow's pod reaches
        {"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    container["ports"] = [{"name": "rdzv", "containerPort": "{{ rdzv_port }}"}]
    resources = container.setdefault("resources", {})
    for kind in ("limits", "requests"):
        resources.setdefault(kind, {})["nvidia.com/gpu"] = "{{ gpus }}"
    container.setdefault("volumeMounts", []).append({"name": "dshm", "mountPath": "/dev/shm"})
    pod.setdefault("volumes", []).append({"name": "dshm", "emptyDir": {"medium": "Memory"}})  # NCCL's shared memory
    tolerations = pod.setdefault("tolerations", [])
    if not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    return out


def rdzv_service(name: str = "unirl-rdzv", namespace: str = "default", port: int = DEFAULT_RDZV_PORT) -> dict[str, Any]:
    """The headless Service whose DNS name is the rendezvous endpoint: it selects the node-0 pod
    of the run that uses it (published before the pod is ready: the store starts before any
    readiness could be judged)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": {RDZV_LABEL: name}},
        "spec": {
            "clusterIP": "None", "publishNotReadyAddresses": True,
            "selector": {RDZV_LABEL: name, NODE_LABEL: "node-0"},
            "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }

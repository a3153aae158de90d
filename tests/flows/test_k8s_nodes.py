"""The Kubernetes side of multi-node runs, without a cluster: the node-agent work pool's job
template rendered the way the Prefect Kubernetes worker renders it for a flow run (its own job
configuration class), validated against the Kubernetes API schema (kubernetes-validate, strict),
and the wiring checked: GPUs, the rendezvous Service in front of node 0, the control secret, the
storage credentials, the pod IP rank 0 advertises."""
from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from tests import zygote
from tests.conftest import REPO
from unirl.flows.k8s_nodes import NODE_LABEL, RDZV_LABEL, flow_template, node_template, rdzv_service
from unirl.stages.runtime.multinode import RDZV_ENV, SECRET_ENV
from unirl.stages.workers.rendezvous import HOST_ENV

K8S = kubernetes_validate.latest_version()


def render(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The Job the Prefect Kubernetes worker would submit for a flow run with these job variables.
    (No block or variable placeholders here, so its client is never called.)"""
    jsonschema.validate(values, template["variables"])  # what the server checks job variables against

    async def configure() -> KubernetesWorkerJobConfiguration:
        async with PrefectClient("http://127.0.0.1:9/api") as client:
            return await KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=client)

    config = asyncio.run(configure())
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="tiny-2node/node-0", flow_id=uuid.uuid4()))
    return config.job_manifest


def env_of(manifest: dict[str, Any]) -> dict[str, Any]:
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_default_template_itself_fails_strict_validation() -> None:
    """The validator is not a rubber stamp: Prefect's default template puts the Job's completions
    and parallelism inside the pod spec, which the Kubernetes schema rejects."""
    manifest = render(KubernetesWorker.get_default_base_job_template(), {"image": "registry.example.com/unirl:1"})
    with pytest.raises(kubernetes_validate.ValidationError, match="completions"):
        kubernetes_validate.validate(manifest, K8S, strict=True)


def test_node_pods_render_valid_and_are_wired_for_the_rendezvous() -> None:
    template = node_template(KubernetesWorker.get_default_base_job_template(), gpus=4, control_secret="unirl-ctl",
                             storage_secret="unirl-s3", rdzv_service="unirl-rdzv-tiny")
    service = rdzv_service("unirl-rdzv-tiny", namespace="ml")
    kubernetes_validate.validate(service, K8S, strict=True)
    pods = {}
    for index in (0, 1):
        manifest = render(template, {"image": "registry.example.com/unirl:1", "namespace": "ml", "node_index": index,
                                     "env": {"PREFECT_API_URL": "http://prefect.ml:4200/api"}})
        kubernetes_validate.validate(manifest, K8S, strict=True)
        pods[index] = manifest
    for index, manifest in pods.items():
        assert manifest["kind"] == "Job" and manifest["metadata"]["namespace"] == "ml"
        pod = manifest["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4 == container["resources"]["requests"]["nvidia.com/gpu"]
        env = env_of(manifest)
        # the rendezvous endpoint is the headless Service's DNS name, on the port the Service serves
        host, port = env[RDZV_ENV].split(":")
        assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        # the control secret from the Secret (never a literal), storage credentials from the environment
        assert env[SECRET_ENV] == {"secretKeyRef": {"name": "unirl-ctl", "key": SECRET_ENV}}
        assert container["envFrom"] == [{"secretRef": {"name": "unirl-s3"}}]
        assert env[HOST_ENV] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["PREFECT_API_URL"] == "http://prefect.ml:4200/api"  # the job variables' env is kept
        labels = pod["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert selected == (index == 0), f"node {index}: the Service must select node 0 only"
        assert labels[NODE_LABEL] == f"node-{index}" and labels[RDZV_LABEL] == "unirl-rdzv-tiny"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def test_the_flow_pod_gets_the_same_secrets_and_no_gpus() -> None:
    manifest = render(flow_template(KubernetesWorker.get_default_base_job_template(), control_secret="unirl-ctl",
                                    storage_secret="unirl-s3"), {"image": "registry.example.com/unirl:1"})
    kubernetes_validate.validate(manifest, K8S, strict=True)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert env_of(manifest)[SECRET_ENV] == {"secretKeyRef": {"name": "unirl-ctl", "key": SECRET_ENV}}
    assert container["envFrom"] == [{"secretRef": {"name": "unirl-s3"}}]
    assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))


def test_the_cli_writes_the_templates_of_docs_deploy_md(tmp_path) -> None:
    def cli(*args: str, stdin: Any = None) -> Any:
        """`python -m unirl.flows.deploy ARGS`'s JSON, forked from the suite's warm interpreter
        (tests/zygote.py) as a fresh one would run it."""
        made = zygote.run([sys.executable, "-m", "unirl.flows.deploy", *args], stdin=stdin, capture_output=True, text=True,
                          cwd=REPO)
        assert made.returncode == 0, made.stderr
        return json.loads(made.stdout)

    default = tmp_path / "default.json"
    default.write_text(json.dumps(KubernetesWorker.get_default_base_job_template()))
    with default.open() as stdin:
        nodes = cli("k8s-node-template", "--gpus", "8", stdin=stdin)
    assert nodes["variables"]["properties"]["gpus"]["default"] == 8 and "node_index" in nodes["variables"]["properties"]
    assert cli("k8s-rdzv-service", "--name", "unirl-rdzv", "--namespace", "ml") == rdzv_service("unirl-rdzv", "ml")
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "python -m unirl.flows.deploy k8s-node-template --gpus 8 < default.json" in docs and "k8s-rdzv-service" in docs

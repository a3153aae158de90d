"""prefect.yaml stays in step with recipes/, the Kubernetes GPU template, and the hook that
stops a run's worker group from another process."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import Flow
from prefect.flows import load_flow_from_entrypoint

from tests.conftest import REPO, TINY
from unirl.flows.deploy import k8s_gpu_template, main, recipe_deployments, render, update
from unirl.flows.forms import entrypoint
from unirl.flows.hooks import run_storage_url, stop_workers, worker_processes
from unirl.stages.recipe import Recipe, load_recipe


def test_prefect_yaml_is_generated_from_the_recipes() -> None:
    assert main(["check"]) == 0, "prefect.yaml is stale: run `python -m unirl.flows.deploy write`"


def test_every_shipped_recipe_is_a_schema_enforced_deployment() -> None:
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"] if d["entrypoint"] != "unirl.flows.nodes:node_agent"}
    agents = {d["name"]: d for d in config["deployments"] if d["entrypoint"] == "unirl.flows.nodes:node_agent"}
    recipes = sorted((REPO / "recipes").glob("*/*.yaml"))
    assert recipes
    for path in recipes:
        recipe = load_recipe(path, local_files=False)  # a teacher folder another run makes need not exist here
        dep = deployments[recipe.name]
        assert dep["entrypoint"] == entrypoint("sft" if path.parent.name == "sft" else "rl_train", recipe)
        assert dep["enforce_parameter_schema"] is True
        assert dep["work_pool"]["name"] == "cpu"
        assert Recipe.model_validate(dep["parameters"]["recipe"], context={"local_files": False}) == recipe
        # a recipe of several nodes also ships the deployment that starts its other nodes' agents
        assert (recipe.name in agents) == (recipe.train.nnodes > 1), recipe.name
        if recipe.name in agents:
            assert agents[recipe.name]["parameters"]["recipe"] == dep["parameters"]["recipe"]
            assert recipe.train.agents.deployment == f"node-agent/{recipe.name}"
            assert "concurrency_limit" not in agents[recipe.name]  # one run per other node, at once
    for dep in config["deployments"]:  # a worker loads the flow from the installed package, whatever its directory
        assert isinstance(load_flow_from_entrypoint(dep["entrypoint"], use_placeholder_flow=False), Flow), dep["entrypoint"]
    nightly = deployments["tiny-nightly"]
    assert nightly["schedules"][0]["cron"] == "0 3 * * *"
    assert nightly["parameters"]["recipe"] == deployments["tiny"]["parameters"]["recipe"]
    trigger = deployments["tiny-on-prompts"]["triggers"][0]
    assert trigger["expect"] == ["unirl.prompts.landed"]


def test_update_replaces_only_the_generated_block(tmp_path: Path) -> None:
    deps = recipe_deployments()
    text = (REPO / "prefect.yaml").read_text()
    assert update(text, deps) == text
    edited = text.replace("limit: 1", "limit: 2")
    assert update(edited, deps) == edited
    with pytest.raises(ValueError, match="markers"):
        update("deployments: []\n", deps)
    assert "recipe: &recipe-tiny" in render(deps)


def test_a_recipe_folder_without_a_flow_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "recipes" / "nowhere").mkdir(parents=True)
    (tmp_path / "recipes" / "nowhere" / "x.yaml").write_text("name: x\n")
    with pytest.raises(ValueError, match="no flow for recipe folder 'nowhere'"):
        recipe_deployments(tmp_path)


def test_k8s_template_requests_gpus() -> None:
    base: dict[str, Any] = {
        "variables": {"type": "object", "properties": {"image": {"type": "string"}}},
        "job_configuration": {"job_manifest": {"spec": {"template": {"spec": {
            "containers": [{"name": "prefect-job", "image": "{{ image }}"}]}}}}},
    }
    out = k8s_gpu_template(base, gpus=2)
    assert out["variables"]["properties"]["gpus"]["default"] == 2
    pod = out["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "resources" not in base["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]


def test_stop_workers_kills_a_runs_processes_and_only_those(tmp_path: Path) -> None:
    """What the on_cancellation hook does from the worker's process: find the run's
    `-m unirl.stages.workers --spec FILE` processes (a relative root is relative to their cwd)."""
    procs = []
    for run in ("mine", "other"):
        spec = tmp_path / f"{run}.json"
        spec.write_text(json.dumps({"root": "runs", "run": run, "options": {}}))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", "-m", "unirl.stages.workers", "--spec", str(spec)],
            cwd=tmp_path, start_new_session=True,
        ))
    try:
        recipe = load_recipe(TINY, [f"storage.root={tmp_path / 'runs'}"]).model_dump(mode="json")
        url = run_storage_url({"recipe": recipe, "run_name": "mine"})
        assert url == str(tmp_path / "runs" / "mine")
        deadline = time.monotonic() + 10
        while len(worker_processes(lambda u: u.startswith(str(tmp_path)))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stop_workers(url) == 1
        procs[0].wait(timeout=10)  # already reaped by stop_workers, which waits for what it killed
        assert procs[1].poll() is None
        assert [p.pid for p in worker_processes(lambda u: u.startswith(str(tmp_path)))] == [procs[1].pid]
    finally:
        for p in procs:
            p.kill()
            p.wait()

"""unirl the Prefect way, against a real server: `prefect server start` (SQLite in a temp dir),
a process work pool and `prefect worker`, deployments from prefect.yaml, `prefect deployment run`,
artifacts read back through the API, the parameter schema enforced by the server, a run cancelled
(its torchrun worker group must go with it) and resumed, an event-triggered run, a schedule.

The tests share the session's Prefect server (tests/prefect_server.py) and one worker (module
fixture), and run in file order.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.conftest import REPO, TINY
from tests.prefect_server import PrefectServer
from unirl.flows.hooks import worker_processes

pytestmark = pytest.mark.slow

class Deployments:
    """The session's Prefect server (tests/prefect_server.py) with this module's process work pool
    `cpu`, its worker and the run folders of its deployments."""

    def __init__(self, server: PrefectServer, runs: Path):
        self.server, self.runs, self.url = server, runs, server.url
        self.env = {**server.env, "PREFECT_LOGGING_LEVEL": "INFO"}  # the hooks' log lines reach the API
        self.worker: subprocess.Popen | None = None

    def cli(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return self.server.cli(*args, env=self.env, **kwargs)

    def log(self, name: str) -> str:
        return self.server.log(name)

    def client(self) -> Any:
        return self.server.client()

    def flow_runs(self, deployment: str) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        with self.client() as c:
            dep = c.read_deployment_by_name(deployment)
            return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))



AS_WRITTEN = ("retrain/tiny-nightly", "rl-train/pe-quickstart", "rl-train/unified-quickstart")
RUN_HERE = ("tiny", "tiny-on-prompts")


def tiny_recipe(**changes: Any) -> dict[str, Any]:
    recipe = yaml.safe_load(TINY.read_text())
    for key, value in changes.items():
        node = recipe
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return recipe


@pytest.fixture(scope="module")
def server(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory):
    srv = Deployments(prefect_server, tmp_path_factory.mktemp("deploy") / "runs")
    try:
        srv.cli("work-pool", "create", "cpu", "--type", "process")
        # Deployments of prefect.yaml in one `prefect deploy` (each CLI start costs seconds): some
        # as written (every one of them is checked against its recipe in tests/flows/test_deploy.py;
        # deploying all 29 here took 85 s): the schedule, one per composed mode; and the ones this
        # test runs, from a copy of the file whose recipe puts their run folders in the temp dir.
        project = yaml.safe_load((REPO / "prefect.yaml").read_text())
        ours = tiny_recipe(**{"storage.root": str(srv.runs), "eval.enabled": False})
        for deployment in project["deployments"]:
            if deployment["name"] in RUN_HERE:
                deployment["parameters"]["recipe"] = ours
        copy = srv.runs.parent / "prefect.yaml"
        copy.write_text(yaml.safe_dump(project, sort_keys=False))
        srv.cli("--no-prompt", "deploy", "--prefect-file", str(copy), *[a for name in (*AS_WRITTEN, *RUN_HERE) for a in ("--name", name)],
                timeout=300)
        srv.worker = prefect_server.start("worker", "worker", "start", "--pool", "cpu", "--type", "process", env=srv.env)
        yield srv
    finally:
        tree: list[psutil.Process] = []
        if srv.worker is not None:
            try:
                tree = psutil.Process(srv.worker.pid).children(recursive=True)
            except psutil.Error:
                pass
            prefect_server.stop(srv.worker)
        strays = worker_processes(lambda url: url.startswith(str(srv.runs)))
        for p in tree + strays:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree + strays, timeout=10)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(what: str, check, timeout: float, server: Deployments, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\nworker log:\n{server.log('worker')}")


def test_deployments_carry_the_recipe_schema_and_the_schedule(server: Deployments) -> None:
    with server.client() as c:
        dep = c.read_deployment_by_name("rl-train/tiny")
        nightly = c.read_deployment_by_name("retrain/tiny-nightly")
        on_prompts = c.read_deployment_by_name("rl-train/tiny-on-prompts")
        composed = [c.read_deployment_by_name(name) for name in AS_WRITTEN[1:]]
        automations = c.read_automations()
    for mode in composed:  # a pipeline and a unified model: each mode a schema-enforced deployment
        assert mode.enforce_parameter_schema and mode.parameters["recipe"]["name"] == mode.name
    assert dep.enforce_parameter_schema and dep.work_pool_name == "cpu"
    assert {"unirl", "rl-train"} <= set(dep.tags)
    schema = dep.parameter_openapi_schema
    assert {"recipe", "run_name", "iterations", "overrides"} <= set(schema["properties"])
    recipe = schema["properties"]["recipe"]  # the recipe's own variants (flows/forms.py), inline
    for section in ("model", "data", "rollout", "reward", "advantage", "algorithm", "train", "storage", "tracking"):
        assert recipe["properties"][section]["description"], section
    assert recipe["properties"]["model"]["properties"]["kind"]["const"] == "qwen3"
    assert recipe["properties"]["train"]["properties"]["lr"]["description"] == "AdamW learning rate."
    assert recipe["properties"]["train"]["properties"]["lr"]["exclusiveMinimum"] == 0
    # The deployment's default parameters are the shipped recipe (here with the temp run folder).
    assert dep.parameters["recipe"]["algorithm"] == {"name": "grpo", "clip_low": 0.2, "clip_high": 0.28}

    # The nightly retraining deployment is created with its cron schedule (shipped paused).
    assert len(nightly.schedules) == 1
    schedule = nightly.schedules[0]
    assert schedule.schedule.cron == "0 3 * * *" and schedule.schedule.timezone == "UTC"
    assert schedule.active is False
    assert nightly.parameters["lineage"] == "tiny"

    # The event trigger became an automation that runs rl-train/tiny-on-prompts.
    mine = [a for a in automations if any(getattr(act, "deployment_id", None) == on_prompts.id for act in a.actions)]
    assert len(mine) == 1 and mine[0].enabled
    assert "unirl.prompts.landed" in mine[0].trigger.expect


def test_invalid_parameters_are_rejected_before_a_run_starts(server: Deployments) -> None:
    before = len(server.flow_runs("rl-train/tiny"))
    bad = json.dumps({"recipe": tiny_recipe(**{"train.lr": -1.0, "storage.root": str(server.runs)})})
    out = server.cli("deployment", "run", "rl-train/tiny", "--params", bad, check=False)
    assert out.returncode != 0
    assert "recipe.train.lr" in out.stdout + out.stderr
    out = server.cli("deployment", "run", "rl-train/tiny", "--param", "iterations=0", check=False)
    assert out.returncode != 0 and "iterations" in out.stdout + out.stderr
    # a typo inside a section is named (the form's schema is the recipe's own model, not a union)
    typo = tiny_recipe(**{"storage.root": str(server.runs)})
    typo["model"]["tiny"]["hiden_size"] = 32
    out = server.cli("deployment", "run", "rl-train/tiny", "--params", json.dumps({"recipe": typo}), check=False)
    assert out.returncode != 0 and "'hiden_size' was unexpected" in out.stdout + out.stderr
    assert len(server.flow_runs("rl-train/tiny")) == before


def test_deployment_run_completes_with_artifacts(server: Deployments) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId

    started = time.monotonic()
    # A name given to the flow run (the Run form's "Run Name") with `run_name` left empty is the run's folder.
    out = server.cli("deployment", "run", "rl-train/tiny", "--flow-run-name", "sweep-a", "--param", "iterations=2",
                     "--param", 'overrides=["train.lr=2e-3", "rollout.temperature=0.9"]', "--watch", timeout=600)
    seconds = time.monotonic() - started
    assert "Completed" in out.stdout, out.stdout[-3000:]
    (run,) = server.flow_runs("rl-train/tiny")
    assert run.state.is_completed() and run.name == "tiny/sweep-a"
    run_dir = server.runs / "sweep-a"
    assert all((run_dir / f"iter-{i:06d}" / "_SUCCESS").exists() for i in range(2))
    info = json.loads((run_dir / "run.json").read_text())
    ran = yaml.safe_load((run_dir / "recipe.yaml").read_text())  # the overrides, applied as the CLI applies them
    assert ran["train"]["lr"] == 2e-3 and ran["rollout"]["temperature"] == 0.9

    with server.client() as c:
        artifacts = c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        iterations = c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in iterations])))
        logs = [log.message for log in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
    # the run's own lines are in its Logs tab, not only on the worker's terminal
    assert any(m.startswith("[unirl] run sweep-a at ") and "unirl ui " in m for m in logs), logs
    assert any(m.startswith("[unirl] iter-000001 (2/2)  reward ") for m in logs), logs
    by_key: dict[str, list[Any]] = {}
    for art in artifacts:
        by_key.setdefault(art.key, []).append(art)
    assert {"unirl-sweep-a-iterations", "unirl-sweep-a-progress", "unirl-sweep-a-mlflow", "unirl-sweep-a-summary"} <= set(by_key)

    tables = sorted(by_key["unirl-sweep-a-iterations"], key=lambda a: a.created)
    assert len(tables) == 2  # one version per iteration
    rows = json.loads(tables[-1].data) if isinstance(tables[-1].data, str) else tables[-1].data
    assert [r["iteration"] for r in rows] == [0, 1]
    for column in ("reward_mean", "reward_std", "adv_mean", "adv_std", "loss", "approx_kl", "clip_frac",
                   "generate_s", "train_s", "iteration_s"):
        assert all(isinstance(r[column], (int, float)) for r in rows), column
    success = json.loads((run_dir / "iter-000001" / "_SUCCESS").read_text())
    assert rows[1]["reward_mean"] == pytest.approx(success["metrics"]["rollout/reward_mean"], abs=1e-6)

    (progress,) = by_key["unirl-sweep-a-progress"]
    assert float(progress.data) == 100.0
    (link,) = by_key["unirl-sweep-a-mlflow"]
    page = f"http://127.0.0.1:5000/#/experiments/1/runs/{info['mlflow_run_id']}?workflowType=machine_learning"  # `unirl ui`
    assert page in str(link.data) and info["mlflow_url"].endswith(page)
    assert f"unirl ui sqlite:///{server.runs / 'mlflow.db'}" in str(link.description)  # the storage root's one store
    # The link's store opens the run; its samples table is one MLflow's table views list, with its columns.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=str(link.description).split("unirl ui ")[1].split()[0].strip("`'"))
    mlrun = client.get_run(info["mlflow_run_id"])
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "rollout/reward_mean")] == [0, 1]
    assert {"path": "tables/samples/step-000000.json", "type": "table"} in json.loads(mlrun.data.tags["mlflow.loggedArtifacts"])
    table = json.loads(Path(client.download_artifacts(mlrun.info.run_id, "tables/samples/step-000000.json", str(run_dir))).read_text())
    assert table["columns"] == ["sample_id", "prompt", "response", "finish_reason", "reward", "reward/exact_match",
                                "reward/integer_format", "advantage", "version"]
    assert mlrun.data.tags["prefect.flow_run_id"] == str(run.id) and mlrun.data.tags["prefect.deployment"] == "tiny"
    (summary,) = by_key["unirl-sweep-a-summary"]
    assert "iter-000000" in summary.data and "iter-000001" in summary.data
    assert str(run_dir / "weights" / "v000002") in summary.data
    assert f"[run {info['mlflow_run_id']}]({page})" in summary.data  # the summary links the MLflow run

    assert sorted(r.name for r in iterations) == ["sweep-a/iter-000000", "sweep-a/iter-000001"]
    ours = {r.id for r in iterations}
    tagged = {t.name.split("-")[0]: set(t.tags) for t in tasks if t.flow_run_id in ours}
    assert "gpu" in tagged["generate"] and "gpu" in tagged["train"] and "gpu" not in tagged["score"]
    assert {"unirl", "recipe:tiny", "run:sweep-a"} <= tagged["score"]
    print(f"\n[deploy] rl-train/tiny, 2 iterations through the worker: {seconds:.1f}s")


def test_event_starts_a_run_cancel_stops_its_workers_and_it_resumes(server: Deployments) -> None:
    run_dir = server.runs / "landed"
    server.cli("event", "emit", "unirl.prompts.landed", "--resource-id", "unirl.prompts.arithmetic",
               "--payload", json.dumps({"run_name": "landed"}))
    run = wait_for("the event to start rl-train/tiny-on-prompts",
                   lambda: next(iter(server.flow_runs("rl-train/tiny-on-prompts")), None), 90, server)
    assert run.parameters["run_name"] == "landed"

    # Cancel once the worker group is up and has committed the first rollouts.
    def first_rollouts():
        with server.client() as c:
            state = c.read_flow_run(run.id).state
        assert not state.is_final(), f"the run ended before it could be cancelled: {state.name}: {state.message}"
        return (run_dir / "iter-000000" / "manifests" / "generate.json").exists()

    wait_for("the first rollouts", first_rollouts, 240, server)
    url = str(run_dir)
    group = worker_processes(lambda u: u == url)
    assert group, "no torchrun worker group found for the run"
    assert server.worker is not None
    worker = psutil.Process(server.worker.pid)
    assert {p.pid for p in group} <= {p.pid for p in worker.children(recursive=True)}
    with server.client() as c:
        from prefect.states import Cancelling

        c.set_flow_run_state(run.id, Cancelling(), force=True)
    started = time.monotonic()

    def cancelled():
        with server.client() as c:
            return c.read_flow_run(run.id).state.is_cancelled()

    wait_for("the run to be Cancelled", cancelled, 120, server)
    alive = [p for p in worker.children(recursive=True) if _alive(p)]
    assert not alive, [" ".join(p.cmdline()) for p in alive]
    assert not worker_processes(lambda u: u == url), "orphaned worker-group processes"
    assert not any(_alive(p) for p in group)
    print(f"\n[deploy] cancel -> Cancelled with no worker processes left: {time.monotonic() - started:.1f}s")

    def hook_logged():
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        with server.client() as c:
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        return any(f"worker group of {url} stopped" in log.message for log in logs)

    wait_for("the on_cancellation hook's log line", hook_logged, 30, server)

    # The cancelled run resumes under another deployment with the same run name.
    generate = (run_dir / "iter-000000" / "manifests" / "generate.json").read_bytes()
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    started = time.monotonic()
    out = server.cli("deployment", "run", "rl-train/tiny", "--param", "run_name=landed", "--param", "iterations=2",
                     "--watch", timeout=600)
    assert "Completed" in out.stdout, out.stdout[-3000:]
    assert all((run_dir / f"iter-{i:06d}" / "_SUCCESS").exists() for i in range(2))
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_id
    assert (run_dir / "iter-000000" / "manifests" / "generate.json").read_bytes() == generate
    assert not worker_processes(lambda u: u == url)
    print(f"[deploy] resumed to completion: {time.monotonic() - started:.1f}s")

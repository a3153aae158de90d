"""The whole RL loop through the real CLI: Prefect's ephemeral API, a torchrun FSDP2 worker
group (gloo), Arrow shards in storage, MLflow on SQLite."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.ipc as ipc
import pytest
from mlflow.tracking import MlflowClient

from tests import zygote
from tests.browser import CHROMIUM, chromium
from tests.conftest import REPO, TINY, isolated_env, run_unirl
from tests.prefect_server import free_port
from unirl.flows.hooks import worker_processes
from unirl.stages.kernels.advantage import group_advantages

pytestmark = pytest.mark.slow

# integer_format gives the random tiny model a reward signal, so the policy really changes.
SIGNAL = "reward.scorers=[{name: integer_format}]"
STAGE_FILES = ["requests.arrow", "rewards.arrow", "advantages.arrow", "train.json", "_SUCCESS"]


def check_layout(run: Path, iterations: int) -> None:
    assert (run / "recipe.yaml").is_file() and (run / "run.json").is_file()
    for i in range(iterations):
        d = run / f"iter-{i:06d}"
        for name in STAGE_FILES:
            assert (d / name).is_file(), f"{d / name} missing"
        assert sorted(p.name for p in (d / "rollouts").iterdir()) == [f"part-{k:03d}.arrow" for k in range(len(list((d / "rollouts").iterdir())))]
    assert (run / "weights" / "v000000" / "manifest.json").is_file()


def assert_no_pickles(run: Path) -> None:
    for path in run.rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in bytes(range(2, 6))), f"{path} is a pickle"
            assert path.suffix not in (".pt", ".pkl", ".pickle", ".distcp", ".bin"), f"{path} is a torch/pickle file"


REFERENCE = ["run", str(TINY), "iterations=4", SIGNAL, "checkpoint_every=3"]


# A second run of the same recipe on the same storage root, at the same time as the reference.
BESIDE = ["run", str(TINY), "iterations=2", SIGNAL, "eval.enabled=false", "--run-name", "tiny-b"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_server):
    """One uninterrupted run the tests below look into and compare with: 4 iterations, a
    checkpoint after the third, MLflow in the storage root's one store (the default), iteration
    flow runs started ahead; and beside it, at the same time, a short second run of the recipe
    writing the same store (`tiny-b`)."""
    root = tmp_path_factory.mktemp("reference") / "runs"
    # Its iteration flow runs start ahead (flows/ahead.py; off by default on a CPU): the SIGKILL
    # test's run, one after the other, must end the same. System metrics every 2 s (not 10): a
    # short run has some.
    env = {**isolated_env(root.parent), **prefect_server.client_env, "UNIRL_OVERLAP_ITERATIONS": "on",
           "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "2"}
    beside = zygote.popen([sys.executable, "-m", "unirl.flows.cli", *BESIDE, f"storage.root={root}"], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = run_unirl([*REFERENCE, f"storage.root={root}"], env)
        tail = beside.communicate(timeout=600)[0]
    finally:
        if beside.poll() is None:
            beside.kill()
    assert beside.returncode == 0, tail[-4000:]
    return root / "tiny", out


def test_two_runs_at_once_share_the_roots_store_one_ui_serves_both_and_a_finished_run_says_so(reference, tmp_path):
    import httpx

    run, _ = reference
    root = run.parent
    store = root / "mlflow.db"
    assert store.is_file() and not (run / "mlflow.db").exists() and not (root / "tiny-b" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]  # one experiment per recipe
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["tiny", "tiny-b"] and {r.info.status for r in runs.values()} == {"FINISHED"}
    for name, r in runs.items():
        assert r.info.run_id == json.loads((root / name / "run.json").read_text())["mlflow_run_id"]
        assert r.data.tags["unirl.run"] == name and r.data.tags["prefect.flow_run_id"]
    # MLflow's system metrics, sampled while the run ran
    assert client.get_metric_history(runs["tiny"].info.run_id, "system/cpu_utilization_percentage")
    # `unirl ui ROOT` serves that store: both runs of the experiment, from one server.
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "unirl.flows.cli", "ui", str(root), "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = ui.stdout.readline() if ui.stdout else ""
        assert first.startswith(f"[unirl] MLflow UI of sqlite:///{store} at http://127.0.0.1:{port}"), first
        deadline = time.monotonic() + 120
        while True:
            try:
                found = httpx.post(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                                   json={"experiment_ids": [experiment.experiment_id]}, timeout=10)
                break
            except httpx.TransportError:
                assert ui.poll() is None and time.monotonic() < deadline, "unirl ui never served"
                time.sleep(0.5)
        assert found.status_code == 200
        assert sorted(r["info"]["run_name"] for r in found.json()["runs"]) == ["tiny", "tiny-b"]
        if CHROMIUM is not None:  # as a person sees them (tests/browser.py; skipped without Chromium)
            look_at_the_runs_in_a_browser(port, experiment.experiment_id, json.loads((run / "run.json").read_text()), tmp_path)
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
    # The finished run started again: refused at once, saying how to extend it; nothing trained.
    again = run_unirl([*REFERENCE, f"storage.root={root}"], isolated_env(tmp_path), check=False)
    assert again.returncode == 1 and again.stderr.startswith("error: run 'tiny' is finished (4 iterations, "), again.stderr
    assert "pass iterations=M with M > 4 to extend it" in again.stderr and not (run / "iter-000004").exists()


def look_at_the_runs_in_a_browser(port: int, experiment_id: str, info: dict, tmp_path: Path) -> None:
    """The experiment page lists both runs of the recipe; the page a run links to (run.json's
    `mlflow_url`, on this port) opens on model training, not GenAI, with the Prefect flow run's tag.
    Screenshots go to $UNIRL_SCREENSHOTS (docs/images) when set."""
    base = f"http://127.0.0.1:{port}"
    experiment = chromium("--dump-dom", url=f"{base}/#/experiments/{experiment_id}?workflowType=machine_learning").stdout
    assert ">tiny<" in experiment and ">tiny-b<" in experiment and "matching runs" in experiment
    page = info["mlflow_url"].split("  then ")[-1].replace("http://127.0.0.1:5000", base)  # "<command>  then <page>"
    dom = chromium("--dump-dom", url=page).stdout
    assert 'title="prefect.flow_run_id"' in dom and ">Model metrics<" in dom and ">System metrics<" in dom
    assert ">Runs<" in dom and ">Judges<" not in dom and ">Sessions<" not in dom  # the model-training sidebar, not GenAI's
    folder = Path(os.environ.get("UNIRL_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    for name, url in (("mlflow-one-store-runs", f"{base}/#/experiments/{experiment_id}?workflowType=machine_learning"),
                      ("mlflow-run-page", page)):
        chromium(f"--screenshot={folder / name}.png", url=url, height=1000)
        assert (folder / f"{name}.png").stat().st_size > 10_000


def test_iteration_flow_runs_started_ahead_are_subflows_that_each_complete(reference, prefect_server):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterParentFlowRunId

    run, _ = reference
    with prefect_server.client() as client:
        trains = [r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])))
                  if r.parameters.get("recipe", {}).get("storage", {}).get("root") == str(run.parent) and r.name == "tiny/tiny"]
        assert len(trains) == 1 and trains[0].state.is_completed()
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[trains[0].id])))
    # Exactly the run's iterations, each Completed: none started past the last one, none left waiting.
    assert sorted((r.name, r.state.type.value) for r in subflows) == [(f"tiny/iter-{i:06d}", "COMPLETED") for i in range(4)]


def test_four_iterations_layout_shards_advantages_and_mlflow(tmp_path, reference):
    run, out = reference
    assert "[unirl] iter-000003 (4/4)" in out.stdout
    assert_default_console(out, 4)
    check_layout(run, 4)
    assert_no_pickles(run)
    # Every shard opens with plain pyarrow.
    for shard in run.rglob("*.arrow"):
        ipc.open_file(str(shard)).read_all()
    # The group z-score recomputed from rewards.arrow matches advantages.arrow.
    for i in range(4):
        rewards = ipc.open_file(str(run / f"iter-{i:06d}/rewards.arrow")).read_all()
        adv = ipc.open_file(str(run / f"iter-{i:06d}/advantages.arrow")).read_all()
        r = np.array(rewards.column("reward").to_pylist())
        groups = rewards.column("group_id").to_pylist()
        expected = np.zeros_like(r)
        for g in set(groups):
            idx = [k for k, x in enumerate(groups) if x == g]
            std = r[idx].std()
            expected[idx] = 0.0 if np.all(r[idx] == r[idx][0]) else (r[idx] - r[idx].mean()) / (std + 1e-6)
        got = dict(zip(adv.column("sample_id").to_pylist(), adv.column("advantage").to_pylist()))
        np.testing.assert_allclose([got[s] for s in rewards.column("sample_id").to_pylist()], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(group_advantages(r, groups).numpy(), expected, rtol=1e-5, atol=1e-6)
        # samples carry the version of the weights that produced them
        rollouts = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all()
        assert set(rollouts.column("policy_version").to_pylist()) == {i}
    # The policy learned something: it was trained on a non-zero signal.
    train = [json.loads((run / f"iter-{i:06d}/train.json").read_text()) for i in range(4)]
    assert all(t["metrics"]["grad_norm"] > 0 for t in train)
    assert all(0.0 <= t["metrics"]["behaviour_logp_max_abs_diff"] <= 1e-4 for t in train)  # the sampler's record
    # MLflow on SQLite, the storage root's store: params from the recipe, metrics per iteration.
    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{run.parent / 'mlflow.db'}")
    mlrun = client.get_run(info["mlflow_run_id"])
    assert mlrun.data.params["train.lr"] == "0.003"
    # Links both ways: the MLflow run names its Prefect flow run and the code it ran; run.json its MLflow page;
    # the experiment opens on training runs (MLflow 3's model-training mode), not GenAI traces.
    tags = mlrun.data.tags
    assert tags["prefect.flow_run_id"] and tags["mlflow.source.name"] == "unirl rl-train" and len(tags["unirl.recipe_sha256"]) == 64
    assert len(tags["mlflow.source.git.commit"]) == 40 and tags["unirl.git_dirty"] in ("true", "false")
    assert info["mlflow_url"].endswith(f"/runs/{info['mlflow_run_id']}?workflowType=machine_learning")  # model training
    assert client.get_experiment(mlrun.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert mlrun.data.params["rollout.group_size"] == "4"
    for key in ["rollout/reward_mean", "rollout/reward_std", "rollout/zero_std_group_frac", "train/loss",
                "train/clip_frac", "train/approx_kl", "train/grad_norm", "time/generate_s", "time/train_s"]:
        steps = [m.step for m in client.get_metric_history(info["mlflow_run_id"], key)]
        assert steps == [0, 1, 2, 3], key
    assert mlrun.info.status == "FINISHED"
    # MLflow is the model's home: every published weights version is registered under the recipe's
    # name, pointing at the weights folder, tagged with the run, its version, the manifest's
    # sha256 and, where evaluated, the held-out metrics; every iteration logs a samples table.
    versions = {int(v.tags["unirl.policy_version"]): v
                for v in client.search_model_versions("name = 'tiny' and tags.`unirl.run` = 'tiny'")}  # not tiny-b's
    assert sorted(versions) == [0, 3, 4]
    for version, mv in versions.items():
        manifest = json.loads((run / f"weights/v{version:06d}/manifest.json").read_text())
        assert mv.source == str(run / f"weights/v{version:06d}") and mv.run_id == info["mlflow_run_id"]
        assert mv.tags["unirl.run"] == "tiny"
        assert mv.tags["unirl.manifest_sha256"] == hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    for version in (0, 4):
        accuracy = json.loads((run / f"eval/v{version:06d}/metrics.json").read_text())["metrics"]["eval/accuracy"]
        assert float(versions[version].tags["eval/accuracy"]) == pytest.approx(accuracy)
    assert "eval/accuracy" not in versions[3].tags
    # The test split: evaluated before and after RL, logged once after RL, on prompts that neither
    # the dev split nor any training iteration holds.
    assert sorted(m.step for m in client.get_metric_history(info["mlflow_run_id"], "test/accuracy")) == [0, 4]
    assert float(versions[4].tags["test/accuracy"]) == pytest.approx(
        json.loads((run / "eval/v000004/test/metrics.json").read_text())["metrics"]["test/accuracy"])

    def prompts(path: Path) -> set[str]:
        return set(ipc.open_file(str(path)).read_all().column("prompt").to_pylist())

    dev, test = prompts(run / "eval/v000000/greedy-requests.arrow"), prompts(run / "eval/v000000/test/greedy-requests.arrow")
    trained = set().union(*(prompts(run / f"iter-{i:06d}/requests.arrow") for i in range(4)))
    assert dev and test and not dev & test and not (dev | test) & trained
    local = client.download_artifacts(info["mlflow_run_id"], "tables/samples/step-000003.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == ["sample_id", "prompt", "response", "finish_reason", "reward", "reward/integer_format",
                                "advantage", "version"] and len(table["data"]) == 16
    assert {row[3] for row in table["data"]} <= {"stop", "length"}
    assert {row[-1] for row in table["data"]} == {3}  # sampled by the weights after 3 train steps
    # MLflow's table views list it (the tag its own log_table keeps), and its artifacts are beside the store.
    listed = json.loads(mlrun.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "tables/samples/step-000003.json", "type": "table"} in listed
    assert mlrun.info.artifact_uri.startswith(str(run.parent / "mlartifacts"))
    assert any((run.parent / "mlartifacts").rglob("step-000003.json"))
    # The registry page shows what a version takes and gives: MLflow's own reader finds its signature and example.
    from mlflow.models import Model

    card = Model.load(f"{versions[4].source}/MLmodel")  # what the page reads: the MLmodel at the version's source
    assert card.signature.inputs.input_names() == ["prompt"] and card.signature.outputs.input_names() == ["response"]
    example = json.loads((run / "weights/v000004" / card.saved_input_example_info["artifact_path"]).read_text())
    assert re.fullmatch(r"\d\+\d=", example["prompt"][0])  # a training prompt of the recipe's sums
    # checkpoint_every=3: a checkpoint after iteration 2 and the final one after iteration 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["000003", "000004"]
    assert (run / "weights" / "v000004" / "model.safetensors").is_file()


def same_as(run: Path, ref_run: Path, iterations: int) -> None:
    """The run's iterations trained and rewarded exactly as the uninterrupted reference run's."""
    for i in range(iterations):
        a = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        b = json.loads((ref_run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], i
        ra = json.loads((run / f"iter-{i:06d}/_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        rb = json.loads((ref_run / f"iter-{i:06d}/_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        assert ra == rb, f"iteration {i}: reward {ra} after resume, {rb} uninterrupted"


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# A run started with UNIRL_FAULTS=STOP_AT_SYNC stops itself (SIGSTOP) once iteration 1 trained and
# synced, before it commits (stages/runtime/faults.py): a test's SIGKILL then lands there for certain.
STOP_AT_SYNC = "sync@1:stop"


def wait_stopped(proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
        assert time.monotonic() < deadline, "the run never reached the point where it stops"
        time.sleep(0.05)


def test_sigkill_mid_iteration_resumes_without_loss_or_duplication(tmp_path, ephemeral_env, unirl_env, reference):
    """As a user first runs it: Prefect's ephemeral API server (which must die with the run) and
    MLflow in the run folder. While it runs, the same run started again is refused."""
    second_env, unirl_env = unirl_env, ephemeral_env
    root = tmp_path / "runs"
    args = [*REFERENCE, f"storage.root={root}"]
    # The run stops itself once iteration 1 trained and synced, before it commits: the group
    # holds a version that no checkpoint has, so the resumed run must restore and replay, not
    # retrain. The kill below is ours, from outside, as a user's would be.
    proc = zygote.popen(
        [sys.executable, "-m", "unirl.flows.cli", *args], env={**unirl_env, "UNIRL_FAULTS": STOP_AT_SYNC}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    run = root / "tiny"
    wait_for(run / "lease.json", proc)
    twice = run_unirl(args, second_env, check=False)
    assert twice.returncode == 1
    assert f"run 'tiny' at {run} is being run by host " in twice.stderr and f"pid {proc.pid}, started " in twice.stderr
    wait_stopped(proc)
    assert (run / "iter-000001" / "manifests" / "train.json").exists()
    children = worker_processes(lambda url: url.rstrip("/").endswith(str(run)))  # forked, or the flow's children
    assert children, "no worker group was running"
    api = [c for c in psutil.Process(proc.pid).children() if "prefect.server.api.server" in " ".join(c.cmdline())]
    assert len(api) == 1, "no ephemeral Prefect API server was running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(children + api, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "worker processes outlived the run"
    assert not (api[0].is_running() and api[0].status() != psutil.STATUS_ZOMBIE), "Prefect's ephemeral API server outlived the run"
    assert not (run / "iter-000001" / "_SUCCESS").exists()
    out = run_unirl(args, unirl_env)
    assert "[unirl] iter-000000 (" not in out.stdout and "[unirl] iter-000001 (2/4)" in out.stdout  # resumed after it
    check_layout(run, 4)
    # The same command uninterrupted (the reference run): identical results and final weights.
    ref_run, _ = reference
    same_as(run, ref_run, 4)
    wa = json.loads((run / "weights/v000004/manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    wb = json.loads((ref_run / "weights/v000004/manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    assert wa == wb
    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(info["mlflow_run_id"], "train/loss")] == [0, 1, 2, 3]


def test_a_run_killed_between_checkpoints_and_extended_replays_at_the_rates_it_trained_with(tmp_path, unirl_env):
    """A cosine schedule over the run's first 5 iterations; killed in iteration 3's train (its
    last checkpoint is 2), then the same command with iterations=8: the replayed step and every
    step taken keep their learning rates, and past the first length the schedule stays at its end."""
    root = tmp_path / "runs"
    args = ["run", str(TINY), "train.lr=1e-3", "train.lr_schedule=cosine", "checkpoint_every=2", "eval.enabled=false",
            "reward.scorers=[{name: text_length, weight: 1.0}]", f"storage.root={root}", "--run-name", "ext"]
    killed = run_unirl([*args, "iterations=5"], {**unirl_env, "UNIRL_FAULTS": "train@3"}, check=False)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr[-2000:]
    run = root / "ext"
    assert (run / "iter-000002/_SUCCESS").exists() and not (run / "iter-000003/_SUCCESS").exists()
    out = run_unirl([*args, "iterations=8"], unirl_env)
    assert "[unirl] replaying the train step of iter-000002" in out.stdout and "[unirl] iter-000007 (8/8)" in out.stdout
    check_layout(run, 8)
    metrics = [json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"] for i in range(8)]
    # lr * (1 + cos(pi * k / 5)) / 2 for the first 5 steps, then the schedule's end (min_lr_ratio 0)
    expected = [1e-3 * (1 + np.cos(np.pi * k / 5)) / 2 for k in range(5)] + [0.0] * 3
    np.testing.assert_allclose([m["lr"] for m in metrics], expected, rtol=1e-9, atol=1e-12)
    assert all(m["behaviour_logp_max_abs_diff"] <= 1e-4 for m in metrics)
    assert json.loads((run / "run.json").read_text())["schedule_steps"] == 5


def assert_default_console(out: subprocess.CompletedProcess, iterations: int) -> None:
    """What `unirl run` shows by default (not on a terminal): its own lines, one per iteration and
    per held-out evaluation, where the log file is; none of Prefect's per-task INFO lines, MLflow's
    migrations, progress bars or an offline telemetry error (those are in the log file / the API)."""
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert all(line.startswith("[unirl] ") for line in lines), [x for x in lines if not x.startswith("[unirl] ")][:5]
    assert sum(" iter-0" in line and f"/{iterations})" in line for line in lines) == iterations
    assert sum("held-out v" in line for line in lines) == 2 and any(line.startswith("[unirl] log: ") for line in lines)
    # Top to bottom: the evaluation before RL, every iteration, then the one after RL.
    order = [line for line in lines if " iter-0" in line or "held-out v" in line or line.startswith("[unirl] test v")]
    assert "(before RL)" in order[0] and "(after RL)" in order[-2] and f"({iterations}/{iterations})" in order[-3], order
    assert order[-1].startswith("[unirl] test v")
    # a long wait says what it waits for: dev and test before RL, and after RL
    assert sum(line.startswith("[unirl] evaluating v") for line in lines) == 4
    # the test split is reported once, after RL, beside its value before RL
    (test,) = [line for line in lines if line.startswith("[unirl] test v")]
    assert test.startswith(f"[unirl] test v{iterations:06d} (after RL): accuracy ") and "(v000000 before RL: accuracy " in test
    log = next(line for line in lines if line.startswith("[unirl] log: ")).split(": ", 1)[1]
    text = Path(log).read_text()
    assert re.search(r"Beginning subflow run '[^'/]+/iter-000000'", text) and "Task run 'train-" in text  # Prefect's INFO lines go there
    # each task says what it did, and each iteration's flow run its metric line (what its page in the UI shows)
    assert re.search(r"Task run 'score-[^']*' - score of [^:]+: \d+ rows, 1 file, reward \d\.\d{3}, [^(]*\(\d+\.\d\d s\)", text)
    assert re.search(r"Task run 'train-[^']*' - train of [^:]+: 1 file, loss [-+]\d\.\d{4}, version \d+ \(", text)
    assert re.search(rf"Flow run '[^'/]+/iter-{iterations - 1:06d}' - \[unirl\] iter-{iterations - 1:06d} \({iterations}/{iterations}\)", text)


def test_world_size_two_and_resume_at_another_world_size(tmp_path, unirl_env):
    root = tmp_path / "runs"
    common = [f"storage.root={root}", SIGNAL, "train.micro_batch_size=4", "checkpoint_every=1", "eval.enabled=false"]
    run_unirl(["run", str(TINY), "iterations=2", *common, "train.nproc=2"], unirl_env)
    run = root / "tiny"
    check_layout(run, 2)
    parts = sorted(p.name for p in (run / "iter-000000" / "rollouts").iterdir())
    assert parts == ["part-000.arrow", "part-001.arrow"]
    rows = sum(ipc.open_file(str(run / "iter-000000/rollouts" / p)).read_all().num_rows for p in parts)
    assert rows == 32
    # Sampling does not depend on the rank that made a sample: compare with world size 1.
    one = tmp_path / "one"
    run_unirl(["run", str(TINY), "iterations=1", f"storage.root={one}", *common[1:]], unirl_env)
    def texts(base):
        tables = [ipc.open_file(str(p)).read_all() for p in sorted((base / "iter-000000/rollouts").iterdir())]
        return {s: t for tb in tables for s, t in zip(tb.column("sample_id").to_pylist(), tb.column("text").to_pylist())}
    assert texts(run) == texts(one / "tiny")
    # The world-size-2 checkpoint resumes at world size 1 (DCP reshards), and back at 2.
    out = run_unirl(["run", str(TINY), "iterations=3", *common, "train.nproc=1"], unirl_env)
    assert "[unirl] iter-000002 (3/3)" in out.stdout and "iter-000001 (" not in out.stdout
    assert sorted(p.name for p in (run / "iter-000002" / "rollouts").iterdir()) == ["part-000.arrow"]
    out = run_unirl(["run", str(TINY), "iterations=4", *common, "train.nproc=2"], unirl_env)
    assert "[unirl] iter-000003 (4/4)" in out.stdout
    check_layout(run, 4)
    assert "nproc_per_node: 2" in (run / "recipe.yaml").read_text()
    assert json.loads((run / "checkpoints/000003/extra.json").read_text())["world_size"] == 1
    assert json.loads((run / "checkpoints/000004/extra.json").read_text())["world_size"] == 2


def test_corrupted_shard_fails_naming_the_file(tmp_path, unirl_env):
    root = tmp_path / "runs"
    run = root / "tiny"
    # A committed rollout shard that is not Arrow: scoring must stop, naming the file.
    (run / "iter-000000/rollouts").mkdir(parents=True)
    (run / "iter-000000/rollouts/part-000.arrow").write_bytes(b"garbage")
    (run / "iter-000000/manifests").mkdir()
    (run / "iter-000000/manifests/generate.json").write_text(json.dumps({"files": ["iter-000000/rollouts/part-000.arrow"]}))
    out = run_unirl(["run", str(TINY), "iterations=1", f"storage.root={root}"], unirl_env, check=False)
    assert out.returncode != 0
    assert "iter-000000/rollouts/part-000.arrow: not an Arrow IPC file" in out.stderr
    assert not (run / "iter-000000/_SUCCESS").exists()


def test_resume_with_a_different_recipe_is_refused(reference, unirl_env):
    run, _ = reference
    before = sorted(str(p) for p in run.rglob("*"))
    out = run_unirl([*REFERENCE, "iterations=5", f"storage.root={run.parent}", "train.lr=0.5"], unirl_env, check=False)
    assert out.returncode == 1
    assert "was started with a different recipe" in out.stderr
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written, nothing left behind


def test_a_local_run_outlives_its_prefect_api_server(tmp_path, ephemeral_env, reference):
    """`unirl run` on its own local Prefect API (flows/ephemeral.py): the server is SIGKILLed while
    the run is held inside iteration 1 (stopped at sync, before its commit). The run starts the
    server again behind the same address, finishes, and ends as the uninterrupted run did: every
    iteration once, the same losses. The server's database and log are in the run folder."""
    root = tmp_path / "runs"
    args = [*REFERENCE, f"storage.root={root}"]
    proc = zygote.popen([sys.executable, "-m", "unirl.flows.cli", *args], env={**ephemeral_env, "UNIRL_FAULTS": STOP_AT_SYNC},
                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_stopped(proc)
        api = [c for c in psutil.Process(proc.pid).children() if "prefect.server.api.server" in " ".join(c.cmdline())]
        assert len(api) == 1, "no local Prefect API server was running"
        api[0].kill()
        deadline = time.monotonic() + 30
        while api[0].is_running() and api[0].status() != psutil.STATUS_ZOMBIE:  # the stopped run cannot reap it yet
            assert time.monotonic() < deadline, "the API server did not die"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "Prefect's local API server exited with code -9" in out and "started again on the same address (1 of 5)" in out
    for i in range(4):
        assert out.count(f"[unirl] iter-{i:06d} ({i + 1}/4)") == 1, out
    run = root / "tiny"
    check_layout(run, 4)
    same_as(run, reference[0], 4)
    log = (run / "prefect" / "server.log").read_text()
    assert log.count("starts the server on http://127.0.0.1:") == 2
    assert (run / "prefect" / "prefect.db").is_file()

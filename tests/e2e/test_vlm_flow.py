"""A vision-language run through the real CLI: toy VQA prompts with their images in the shards,
the tiny Qwen-VL in a torchrun worker group, held-out accuracy before and after RL (and from
`unirl evaluate`), and a run killed with SIGKILL that resumes to the metrics of an uninterrupted
one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pyarrow.ipc as ipc
import pytest

from tests import zygote
from tests.conftest import REPO, run_unirl
from tests.e2e.test_rl_flow import STOP_AT_SYNC, assert_no_pickles, wait_stopped
from unirl.flows.hooks import worker_processes

pytestmark = pytest.mark.slow

RECIPE = str(REPO / "recipes/vlm/grpo.yaml")
# The tiny model of the tests, a reward that varies on it, 3 iterations: seconds, not minutes.
SMALL = ["sft=null", "model.tiny.text.hidden_size=32", "model.tiny.text.num_hidden_layers=1",
         "reward.scorers=[{name: text_length, params: {max_length: 3}}]", "rollout.prompts_per_iteration=3",
         "rollout.group_size=4", "rollout.max_new_tokens=3", "train.micro_batch_size=4", "data.heldout_size=4",
         "eval.k=2", "iterations=3", "checkpoint_every=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_server, mlflow_uri):
    from tests.conftest import isolated_env

    root = tmp_path_factory.mktemp("vlm") / "runs"
    env = {**isolated_env(root.parent), **prefect_server.client_env, "MLFLOW_TRACKING_URI": mlflow_uri}
    out = run_unirl(["run", RECIPE, *SMALL, f"storage.root={root}", "--run-name", "ref"], env)
    return root, env, out


def test_images_travel_in_the_shards_and_heldout_accuracy_is_printed(reference):
    root, env, out = reference
    run = root / "ref"
    assert "[unirl] held-out v000000 (before RL): accuracy " in out.stdout
    assert "[unirl] held-out v000003 (after RL): accuracy " in out.stdout
    assert_no_pickles(run)
    requests = ipc.open_file(str(run / "iter-000001/requests.arrow")).read_all()
    rollouts = ipc.open_file(str(run / "iter-000001/rollouts/part-000.arrow")).read_all()
    assert requests.column("image_grids").to_pylist()[0] == [[1, 8, 8]]
    by_group = dict(zip(requests.column("group_id").to_pylist(), requests.column("images").to_pylist()))
    for gid, images in zip(rollouts.column("group_id").to_pylist(), rollouts.column("images").to_pylist()):
        assert images == by_group[gid] and images[0].startswith(b"\x89PNG")
    for i in range(3):
        metrics = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert 0.0 <= metrics["behaviour_logp_max_abs_diff"] <= 1e-4
    evaluated = run_unirl(["evaluate", RECIPE, *SMALL, f"storage.root={root}", "--run-name", "ref", "--version", "2"], env)
    assert "[unirl] held-out v000002: accuracy " in evaluated.stdout
    metrics = json.loads((run / "eval/v000002/metrics.json").read_text())["metrics"]
    assert metrics["eval/prompts"] == 4.0 and 0.0 <= metrics["eval/accuracy"] <= 1.0


def test_sigkill_mid_run_resumes_to_the_uninterrupted_metrics(reference, tmp_path):
    ref_root, env, _ = reference
    root = tmp_path / "runs"
    args = ["run", RECIPE, *SMALL, "eval.enabled=false", f"storage.root={root}", "--run-name", "ref"]
    proc = zygote.popen([sys.executable, "-m", "unirl.flows.cli", *args], env={**env, "UNIRL_FAULTS": STOP_AT_SYNC}, cwd=REPO,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = root / "ref"
    wait_stopped(proc)  # iteration 1 trained, not committed
    assert (run / "iter-000001" / "manifests" / "train.json").exists()
    children = worker_processes(lambda url: url.rstrip("/").endswith(str(run)))  # forked, or the flow's children
    assert children, "no worker group was running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, "worker processes outlived the run"
    assert not (run / "iter-000001" / "_SUCCESS").exists()
    out = run_unirl(args, env)
    assert "[unirl] iter-000000 (" not in out.stdout and "[unirl] iter-000001 (2/3)" in out.stdout
    for i in range(3):
        a = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        b = json.loads((ref_root / f"ref/iter-{i:06d}/train.json").read_text())["metrics"]
        assert {k: a[k] for k in ("loss", "grad_norm", "tokens")} == {k: b[k] for k in ("loss", "grad_norm", "tokens")}, i
        ra = json.loads((run / f"iter-{i:06d}/_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        rb = json.loads((ref_root / f"ref/iter-{i:06d}/_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        assert ra == rb, i
    weights = [json.loads((r / "weights/v000003/manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
               for r in (run, ref_root / "ref")]
    assert weights[0] == weights[1]

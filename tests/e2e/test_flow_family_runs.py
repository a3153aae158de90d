"""Each flow family through the real `unirl run`: its tiny model built and saved once per session
(tests/conftest.py `tiny_weights`), loaded by path, sampled and trained for two iterations in the
torchrun worker group, published as a diffusers folder the family loads back; the rollouts carry
the media their scorers read and MLflow the previews. A Wan run killed with SIGKILL mid-iteration
resumes to the same results and weights as the uninterrupted one."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import yaml
from PIL import Image

from tests import zygote
from tests.conftest import REPO, run_unirl
from tests.tiny import CASES, merged
from unirl.flows.hooks import worker_processes
from unirl.stages.models.flow_family import get_flow_family

pytestmark = pytest.mark.slow

# One algorithm per family here (the matrix test runs all of them on all families in-process).
RUNS = {"flux2_klein": "flow_grpo", "qwen_image": "flow_dppo", "hunyuan_video": "dancegrpo", "hunyuan_video1.5": "nft",
        "wan2.2": "mixgrpo"}
EXTRA: dict[str, Any] = {"nft": {"train": {"ema": {"decay": 0.5}}, "algorithm": {"timesteps": 2}},
         "mixgrpo": {"rollout": {"sampler": {"sde_steps": {"window_size": 2}}}},
         "flow_grpo": {"rollout": {"sampler": {"guidance_scale": 2.0}}}}


def write_recipe(tmp: Path, case: str, algo: str, weights: Path, **over) -> Path:
    data = merged(CASES[case], {"name": f"e2e-{case}", "algorithm": {"name": algo}, "model": {"path": str(weights)},
                                "iterations": 2, "checkpoint_every": 1, "eval": {"enabled": False},
                                "tracking": {"preview_every": 1}}, EXTRA.get(algo, {}), over)
    path = tmp / f"{case}.yaml"
    path.write_text(f"# unirl run {path.name}\n" + yaml.safe_dump(data))
    return path


def read_arrow(path: Path) -> pa.Table:
    return ipc.open_file(pa.memory_map(str(path))).read_all()


def check_run(run: Path, case: str, algo: str, env: dict[str, str], iterations: int) -> None:
    """What a user of any family gets: the shards, the published weights loading back, previews."""
    from mlflow.tracking import MlflowClient

    family = get_flow_family(CASES[case]["model"]["kind"])
    video = "video" in family.produces
    row = read_arrow(run / "iter-000000" / "rollouts" / "part-000.arrow").slice(0, 1).to_pylist()[0]
    if video:
        frames = [Image.open(io.BytesIO(b)) for b in row["media_frames"]]
        assert row["media_png"] is None and len(frames) == 5 and frames[0].size == (16, 16)
    else:
        assert Image.open(io.BytesIO(row["media_png"])).size == (16, 16) and row["media_frames"] is None
    for i in range(iterations):
        train = json.loads((run / f"iter-{i:06d}" / "train.json").read_text())["metrics"]
        assert train["skipped_steps"] == 0 and train["grad_norm"] > 0
        if algo != "nft":
            assert train["behaviour_logp_max_abs_diff"] == 0.0  # the sampler's record, replayed bit for bit
    weights = run / "weights" / f"v{iterations:06d}"
    bundle = family.load(weights, family.config.model_validate(CASES[case]["model"]), "cpu")
    assert family.latent_shape(bundle, family.default_image_size(bundle), family.default_num_frames(bundle))
    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    previews = [a.path for a in client.list_artifacts(info["mlflow_run_id"], "images/rollouts")]
    assert f"images/rollouts/step-000000.{'gif' if video else 'png'}" in previews
    # The samples table: MLflow's table layout, each row's picture (a GIF for a clip) a file beside it
    # that the table view shows in its cell, enlarged from the model's 16 pixels.
    table = json.loads(Path(client.download_artifacts(info["mlflow_run_id"], "tables/samples/step-000000.json", str(run))).read_text())
    picture = "video" if video else "image"
    columns = table["columns"]
    assert columns[:4] == ["sample_id", "prompt", picture, "reward"] and columns[-2:] == ["advantage", "version"]
    assert columns[4:-2] and all(c.startswith("reward/") for c in columns[4:-2])  # the reward's components, each scorer's
    cell = table["data"][0][2]
    assert cell["type"] == "image" and cell["filepath"].endswith(".gif" if video else ".png")
    shown = Image.open(client.download_artifacts(info["mlflow_run_id"], cell["filepath"], str(run)))
    assert shown.size == (128, 128) and getattr(shown, "n_frames", 1) == (5 if video else 1)
    assert {row[-1] for row in table["data"]} == {0}


@pytest.mark.parametrize("case", sorted(RUNS))
def test_each_family_samples_trains_and_publishes_through_unirl_run(case, tmp_path, unirl_env, tiny_weights):
    recipe = write_recipe(tmp_path, case, RUNS[case], tiny_weights(case), storage={"root": str(tmp_path / "runs")})
    out = run_unirl(["run", str(recipe)], unirl_env)
    assert "iter-000001 (2/2)" in out.stdout
    check_run(tmp_path / "runs" / f"e2e-{case}", case, RUNS[case], unirl_env, 2)


@pytest.fixture(scope="module")
def wan_reference(tmp_path_factory, prefect_server, mlflow_uri, tiny_weights):
    """One uninterrupted Wan run of three iterations the SIGKILL test compares with."""
    from tests.conftest import isolated_env

    tmp = tmp_path_factory.mktemp("wan-reference")
    env = {**isolated_env(tmp), **prefect_server.client_env, "MLFLOW_TRACKING_URI": mlflow_uri}
    recipe = write_recipe(tmp, "wan", "flow_grpo", tiny_weights("wan"), iterations=3, storage={"root": str(tmp / "runs")})
    run_unirl(["run", str(recipe)], env)
    return tmp / "runs" / "e2e-wan", recipe, env


def test_wan_through_unirl_run_and_resumed_after_sigkill_identically(wan_reference, tmp_path, unirl_env):
    import psutil

    reference, recipe, env = wan_reference
    check_run(reference, "wan", "flow_grpo", env, 3)
    root = tmp_path / "runs"
    args = ["run", str(recipe), f"storage.root={root}"]
    from tests.e2e.test_rl_flow import STOP_AT_SYNC, wait_stopped

    proc = zygote.popen([sys.executable, "-m", "unirl.flows.cli", *args], env={**unirl_env, "UNIRL_FAULTS": STOP_AT_SYNC},
                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = root / "e2e-wan"
    wait_stopped(proc)  # iteration 1 trained, not yet committed
    assert (run / "iter-000001" / "manifests" / "train.json").exists()
    workers = worker_processes(lambda url: url.rstrip("/").endswith(str(run)))  # forked, or the flow's children
    assert workers, "no worker group was running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "worker processes outlived the run"
    assert not (run / "iter-000001" / "_SUCCESS").exists()
    out = run_unirl(args, unirl_env)
    assert "iter-000000 (" not in out.stdout and "iter-000002 (3/3)" in out.stdout
    for i in range(3):
        a = json.loads((run / f"iter-{i:06d}" / "train.json").read_text())["metrics"]
        b = json.loads((reference / f"iter-{i:06d}" / "train.json").read_text())["metrics"]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), i
        ra = json.loads((run / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        rb = json.loads((reference / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]["rollout/reward_mean"]
        assert ra == rb, i
    sha = lambda r: json.loads((r / "weights/v000003/manifest.json").read_text())["files"]  # noqa: E731
    assert sha(run) == sha(reference)

"""The diffusion quickstart through the real `unirl` CLI with tiny budgets: SFT (VAE warm-up +
flow matching) then Flow-GRPO, on local disk, at world size 2, and on s3:// (moto)."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from PIL import Image

from tests.conftest import REPO, run_unirl

pytestmark = pytest.mark.slow

QUICKSTART = REPO / "recipes" / "diffusion" / "quickstart.yaml"
TINY = ["rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sampler.num_steps=3",
        "train.micro_batch_size=4", "checkpoint_every=1", "eval.enabled=false", "model.tiny.patch_size=4"]
TINY_SFT = ["sft.steps=3", "sft.examples=16", "sft.batch_size=8", "model.vae_warmup.steps=3", "model.vae_warmup.batch_size=8"]


def read_arrow(path):
    return ipc.open_file(pa.memory_map(str(path))).read_all()


def test_quickstart_sft_then_flow_grpo_on_s3(tmp_path, unirl_env):
    """The quickstart's whole path (SFT, held-out evaluation, Flow-GRPO, checkpoints) with its run
    folder on s3:// (moto's server); the folder is then copied down and looked into."""
    import s3fs

    from tests.moto_s3 import moto_endpoint

    with moto_endpoint() as url:
        env = {**unirl_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url}
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": url})
        fs.mkdir("unirl-runs")
        held_out = ["eval.enabled=true", "data.heldout_size=3", "eval.k=2"]
        out = run_unirl(["run", str(QUICKSTART), "storage.root=s3://unirl-runs/team", "iterations=2", *TINY, *TINY_SFT,
                         *held_out], env)
        base = "unirl-runs/team/diffusion-quickstart"
        assert fs.exists(f"{base}/weights/v000000/vae/config.json")
        assert fs.exists(f"{base}/weights/v000002/transformer/diffusion_pytorch_model.safetensors")
        assert json.loads(fs.cat(f"{base}/checkpoints/000002/_COMMITTED"))["version"] == 2
        assert not (REPO / "s3:").exists()
        fs.get(base, str(tmp_path / "diffusion-quickstart"), recursive=True)
    assert "sft step 3/3" in out.stdout and "iter-000001 (2/2)" in out.stdout
    assert "the VAE learns the SFT media first (3 steps of batch 8)" in out.stdout
    assert "VAE warm-up done, reconstruction loss" in out.stdout
    # The held-out toy-GenEval strict score before and after RL (ODE greedy, SDE avg@k / pass@k).
    assert "held-out v000000 (before RL): accuracy" in out.stdout and "held-out v000002 (after RL)" in out.stdout
    final = json.loads((tmp_path / "diffusion-quickstart" / "eval" / "v000002" / "metrics.json").read_text())["metrics"]
    assert final["eval/prompts"] == 3 and 0.0 <= final["eval/avg_at_2"] <= final["eval/pass_at_2"] <= 1.0
    run = tmp_path / "diffusion-quickstart"
    assert (run / "weights" / "v000000" / "manifest.json").is_file(), "SFT publishes the run's initial weights"
    rollouts = read_arrow(run / "iter-000000" / "rollouts" / "part-000.arrow")
    assert rollouts.num_rows == 8
    row = rollouts.slice(0, 1).to_pylist()[0]
    # The quickstart's SDE window is the first 30% of the steps: of 3 steps, step 0 alone.
    assert row["parts"] == ["latent"] and len(row["sigmas"]) == 4 and row["sde_indices"] == [0]
    assert len(row["sde_logprobs"]) == 1
    assert Image.open(io.BytesIO(row["media_png"])).size == (32, 32)
    rewards = read_arrow(run / "iter-000000" / "rewards.arrow")
    assert {"reward/geneval/strict", "reward/geneval/colour", "reward/geneval/position"} <= set(rewards.column_names)
    train = json.loads((run / "iter-000001" / "train.json").read_text())["metrics"]
    assert train["behaviour_logp_max_abs_diff"] == 0.0  # the replay is the sampler's record, bit for bit
    # the rollout grid of iteration 0 (quickstart: every 10 iterations) is in MLflow
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=unirl_env["MLFLOW_TRACKING_URI"])
    assert [a.path for a in client.list_artifacts(info["mlflow_run_id"], "images/rollouts")] == ["images/rollouts/step-000000.png"]
    from unirl.stages.models.sd3 import SD3, SD3ModelConfig

    bundle = SD3.load(run / "weights" / "v000002", SD3ModelConfig(), "cpu")
    assert SD3.default_image_size(bundle) == 32


@pytest.mark.parametrize("recipe", ["nft.yaml", "flow_dppo.yaml"])
def test_world_size_two_with_uneven_micro_batches(tmp_path, unirl_env, recipe):
    """9 samples on 2 ranks with micro-batches of 4: rank 0 has 2 micro-batches, rank 1 one, and
    takes part in the other's collectives with a stand-in (NFT: EMA old policy; DPPO: 2 updates,
    its first replay equal to the sampler's record on both ranks)."""
    path = REPO / "recipes" / "diffusion" / recipe
    run_unirl(["run", str(path), f"storage.root={tmp_path}", "iterations=2", "sft=null", "train.nproc=2",
               "rollout.prompts_per_iteration=3", "rollout.group_size=3", "rollout.sampler.num_steps=3",
               "train.micro_batch_size=4", "checkpoint_every=1", "eval.enabled=false"], unirl_env)
    name = path.stem.replace("_", "-")
    run = tmp_path / f"diffusion-{name}"
    parts = [read_arrow(run / "iter-000001" / "rollouts" / f"part-{k:03d}.arrow") for k in range(2)]
    assert sum(p.num_rows for p in parts) == 9 and min(p.num_rows for p in parts) > 0
    train = json.loads((run / "iter-000001" / "train.json").read_text())["metrics"]
    assert train["samples"] == 9 and train["skipped_steps"] == 0
    if recipe == "flow_dppo.yaml":
        assert train["behaviour_logp_max_abs_diff"] == 0.0
    assert json.loads((run / "checkpoints" / "000002" / "_COMMITTED").read_text())["version"] == 2


@pytest.mark.parametrize("nproc", [1, 2])
def test_dynamic_sampling_on_a_flow_family(tmp_path, unirl_env, nproc):
    """DAPO's refill rounds on toy GenEval: groups whose rewards are all equal are dropped and the
    kept ones are trained in other micro-batches than they were sampled in. A flow replay equals the
    sampler's record only in the same micro-batch, so validate refuses the combination at the flow
    tolerance 0 (before anything loads), and a run that accepts the rounding with a tolerance trains
    the kept groups exactly as sampled, within it, at world size 1 and 2."""
    common = ["run", str(QUICKSTART), f"storage.root={tmp_path}", "iterations=2", "sft=null", f"train.nproc_per_node={nproc}",
              *TINY, "rollout.dynamic_sampling={max_rounds: 3}", "reward.scorers=[{name: geneval, params: {mode: partial}}]"]
    refused = run_unirl(common, unirl_env, check=False)
    assert refused.returncode == 2 and "rollout.dynamic_sampling: the trainer replays the kept groups" in refused.stderr
    assert not (tmp_path / "diffusion-quickstart").exists()
    run_unirl([*common, "rollout.behaviour_tolerance=1e-5"], unirl_env)
    run = tmp_path / "diffusion-quickstart"
    dropped = 0
    for i in range(2):
        metrics = json.loads((run / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        dropped += metrics["rollout/groups_dropped"]
        kept = read_arrow(run / f"iter-{i:06d}" / "advantages.arrow")
        train = json.loads((run / f"iter-{i:06d}" / "train.json").read_text())["metrics"]
        assert train["samples"] == kept.num_rows == 4 * len(set(kept.column("group_id").to_pylist()))
        assert 0.0 <= train["behaviour_logp_max_abs_diff"] <= 1e-5 and train["skipped_steps"] == 0
        rounds = [p for p in (run / f"iter-{i:06d}" / "rollouts").rglob("part-*.arrow")]
        assert len(rounds) == nproc * metrics["rollout/dynamic_rounds"]
    assert dropped > 0  # the refill rounds happened and dropped groups

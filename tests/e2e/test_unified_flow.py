"""A unified model through the real `unirl run`: one tiny transfusion transformer writes a plan for
each prompt and draws it, on two ranks; both stages' losses go into one optimizer step with the
on-policy check of both; the run publishes one line of weights versions; the iteration's flow run
shows each stage's generate as a task run of its own; a run killed with SIGKILL mid-iteration
resumes (its group rebuilt from a checkpoint and the joint train step replayed from storage) to
the uninterrupted run's metrics and weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.composed_runs import composed_rollouts, killed_and_resumed, reference_run

pytestmark = pytest.mark.slow

STAGES = ("plan", "image")
RECIPE = {
    "name": "unified-e2e", "data": {"name": "geneval", "heldout_size": 2},
    "reward": {"scorers": [{"name": "brightness"}]},  # varies on random models: both stages get a signal
    "model": {"kind": "transfusion", "tiny": {"image_size": 16, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                              "intermediate_size": 64, "vae_channels": [8], "text_length": 12}},
    "compose": {"kind": "unified", "stages": [
        {"name": "plan", "rollout": {"kind": "text", "prompts_per_iteration": 2, "group_size": 2, "max_new_tokens": 4},
         "algorithm": {"name": "grpo"}},
        {"name": "image", "rollout": {"kind": "flow", "group_size": 2, "sampler": {"num_steps": 3, "init_same_noise": False}},
         "algorithm": {"name": "flow_grpo"}, "loss_weight": 0.5},
    ]},
    "train": {"micro_batch_size": 4, "nproc_per_node": 2},
    "eval": {"k": 2}, "iterations": 3, "checkpoint_every": 1,
}


def weights_files(run: Path, version: int) -> dict:
    return json.loads((run / "weights" / f"v{version:06d}" / "manifest.json").read_text())["files"]


@pytest.fixture(scope="module")
def unified_reference(tmp_path_factory, prefect_server, mlflow_uri):
    """One uninterrupted unified run of three iterations."""
    return reference_run(tmp_path_factory.mktemp("unified-reference"), prefect_server, mlflow_uri, RECIPE, "unified-reference")


def test_a_unified_run_trains_both_stages_in_one_step(unified_reference, prefect_server, mlflow_uri):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    run, _, out = unified_reference
    assert "iter-000002 (3/3)" in out.stdout and "held-out v000003 (after RL)" in out.stdout
    composed = composed_rollouts(run, rows=2 * 2 * 2, parts=STAGES)  # prompts x plans x images
    train = json.loads((run / "iter-000002" / "train.json").read_text())["metrics"]
    assert train["grad_norm"] > 0 and {"plan/loss", "image/loss"} <= set(train)
    for side in STAGES:  # each stage's replay against its sampler's record, in the one step
        assert train[f"{side}/behaviour_logp_max_abs_diff"] < 1e-4, side
    assert weights_files(run, 3) != weights_files(run, 0)
    assert not (run / "parts").exists()  # one run, one line of weights versions
    metrics = json.loads((run / "iter-000002" / "_SUCCESS").read_text())["metrics"]
    assert {"train/plan/loss", "train/image/loss", "advantage/plan/abs_mean", "advantage/image/abs_mean"} <= set(metrics)
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_uri)
    shown = json.loads(Path(client.download_artifacts(info["mlflow_run_id"], "tables/plans/step-000002.json")).read_text())
    rows = [dict(zip(shown["columns"], r)) for r in shown["data"]]
    by_id = {r["sample_id"]: r for r in composed.to_pylist()}
    assert len(rows) == 8 and all(r["rewrite"] == by_id[r["sample_id"]]["plan/text"] for r in rows)  # each plan beside its image
    versions = sorted(int(v.tags["unirl.policy_version"]) for v in client.search_model_versions("name='unified-e2e'")
                      if v.tags.get("unirl.run") == "unified-reference")
    assert versions == [0, 1, 2, 3]
    with prefect_server.client() as c:
        iterations = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["unified-iteration"])),
                                      flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:unified-reference"])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in iterations])))
    assert sorted(r.name for r in iterations) == [f"unified-reference/iter-{i:06d}" for i in range(3)]
    names = {t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id == iterations[0].id}
    assert {"generate-plan", "generate-image", "compose", "score", "advantage", "train", "sync"} <= names


def test_a_killed_unified_run_resumes_to_the_uninterrupted_results(unified_reference, tmp_path, unirl_env):
    reference, recipe, _ = unified_reference

    def stopped(run: Path) -> None:  # iteration 1: the joint step taken, its sync (checkpoint, publish) not committed
        assert (run / "iter-000001" / "manifests" / "train.json").exists()
        assert not (run / "iter-000001" / "manifests" / "sync.json").exists()

    run, _ = killed_and_resumed(recipe, "unified-reference", tmp_path / "runs", unirl_env, workers_at_least=2,
                                stopped=stopped)
    for i in range(3):
        a = json.loads((run / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        b = json.loads((reference / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        for key in ("rollout/reward_mean", "train/plan/loss", "train/image/loss", "train/grad_norm"):
            assert a[key] == b[key], (i, key)
    assert weights_files(run, 3) == weights_files(reference, 3)

"""A prompt-enhancer pipeline through the real `unirl run`: a tiny Qwen3 rewrites toy-GenEval prompts,
a tiny SD3 draws each rewrite, both sides train (each in its own worker group of two ranks), each
publishes its own weights versions; the iteration's flow run shows each part's generate, train and
sync as task runs of their own; the composed shards open with plain pyarrow; the same run with both
parts in one worker group (`pe.placement: shared`), killed with SIGKILL mid-iteration, resumes to the
uninterrupted run's metrics and both sides' weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.composed_runs import composed_rollouts, killed_and_resumed, reference_run

pytestmark = pytest.mark.slow

RECIPE = {
    "name": "pe-e2e", "data": {"name": "geneval", "heldout_size": 2},
    "reward": {"scorers": [{"name": "brightness"}]},  # varies on random models: both sides get a signal
    "pe": {
        "ar": {"model": {"kind": "qwen3", "tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
                                                   "charset": "abcdefghijklmnopqrstuvwxyz "}},
               "rollout": {"prompts_per_iteration": 2, "group_size": 2, "max_new_tokens": 4},
               "algorithm": {"name": "grpo"}, "train": {"micro_batch_size": 4, "nproc_per_node": 2}},
        "diffusion": {"model": {"kind": "sd3", "tiny": {"image_size": 16}},
                      "rollout": {"group_size": 2, "sampler": {"num_steps": 3, "init_same_noise": False}},
                      "algorithm": {"name": "flow_grpo"}, "train": {"micro_batch_size": 4, "nproc_per_node": 2}},
        "freeze_diffusion": False,
    },
    "eval": {"k": 2}, "iterations": 3, "checkpoint_every": 1,
}


def weights_files(run: Path, side: str, version: int) -> dict:
    return json.loads((run / "parts" / side / "weights" / f"v{version:06d}" / "manifest.json").read_text())["files"]


@pytest.fixture(scope="module")
def pe_reference(tmp_path_factory, prefect_server, mlflow_uri):
    """One uninterrupted pipeline run of three iterations."""
    return reference_run(tmp_path_factory.mktemp("pe-reference"), prefect_server, mlflow_uri, RECIPE, "pe-reference")


def test_a_pipeline_run_trains_both_sides_and_shows_each_part(pe_reference, prefect_server, mlflow_uri):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    run, _, out = pe_reference
    assert "iter-000002 (3/3)" in out.stdout and "held-out v000003 (after RL)" in out.stdout
    composed = composed_rollouts(run, rows=2 * 2 * 2)  # prompts x rewrites x images
    for side in ("ar", "diffusion"):
        train = json.loads((run / "parts" / side / "iter-000002" / "train.json").read_text())["metrics"]
        assert train["grad_norm"] > 0 and train["behaviour_logp_max_abs_diff"] < 1e-4, side  # replay against the sampler's record
        assert weights_files(run, side, 3) != weights_files(run, side, 0), side  # each side published its own versions
    metrics = json.loads((run / "iter-000002" / "_SUCCESS").read_text())["metrics"]
    assert {"train/ar/loss", "train/diffusion/loss", "advantage/ar/abs_mean", "advantage/diffusion/abs_mean"} <= set(metrics)
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert "images/rollouts/step-000002.png" in [a.path for a in client.list_artifacts(info["mlflow_run_id"], "images/rollouts")]
    shown = json.loads(Path(client.download_artifacts(info["mlflow_run_id"], "tables/rewrites/step-000002.json")).read_text())
    rows = [dict(zip(shown["columns"], r)) for r in shown["data"]]
    by_id = {r["sample_id"]: r for r in composed.to_pylist()}
    assert len(rows) == 8 and all(r["rewrite"] == by_id[r["sample_id"]]["text/text"] for r in rows)  # each rewrite beside its image
    versions = {side: sorted(int(v.tags["unirl.policy_version"]) for v in client.search_model_versions(f"name='pe-e2e-{side}'")
                             if v.tags.get("unirl.run") == "pe-reference") for side in ("ar", "diffusion")}
    assert versions == {"ar": [0, 1, 2, 3], "diffusion": [0, 1, 2, 3]}  # each side's published versions, registered
    with prefect_server.client() as c:
        iterations = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pe-iteration"])),
                                      flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:pe-reference"])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in iterations])))
    assert sorted(r.name for r in iterations) == ["iter-000000", "iter-000001", "iter-000002"]
    names = {t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id == iterations[0].id}
    assert {"generate-ar", "generate-diffusion", "compose", "score", "advantage", "train-ar", "train-diffusion",
            "sync-ar", "sync-diffusion"} <= names


def test_a_killed_pipeline_run_in_one_worker_group_resumes_to_the_uninterrupted_results(pe_reference, tmp_path, unirl_env):
    reference, recipe, _ = pe_reference

    def stopped(run: Path) -> None:  # iteration 1: the rewriter trained, its sync under way, the drawer not yet trained
        assert (run / "parts" / "ar" / "iter-000001" / "manifests" / "train.json").exists()
        assert not (run / "parts" / "diffusion" / "iter-000001" / "manifests" / "train.json").exists()

    run, _ = killed_and_resumed(recipe, "pe-reference", tmp_path / "runs", unirl_env, workers_at_least=3, stopped=stopped,
                                overrides=("pe.placement=shared",))
    # one group of two ranks holds both parts; each comes back from its own newest checkpoint (the
    # rewriter's sync of iteration 1 had saved version 2 before the kill, the drawer's had not begun)
    logs = "".join(p.read_text() for p in sorted((run / "logs").glob("*.log")))
    assert "starting worker group: 2 rank(s), members ar at checkpoint 2, diffusion at checkpoint 1" in logs
    for i in range(3):
        a = json.loads((run / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        b = json.loads((reference / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        for key in ("rollout/reward_mean", "train/ar/loss", "train/ar/grad_norm", "train/diffusion/loss",
                    "train/diffusion/grad_norm"):
            assert a[key] == b[key], (i, key)
    for side in ("ar", "diffusion"):
        assert weights_files(run, side, 3) == weights_files(reference, side, 3), side

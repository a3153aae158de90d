"""A three-part pipeline through the real `unirl run`: a tiny Qwen3 rewrites toy-GenEval prompts, a
second one polishes each rewrite, a tiny SD3 draws each polished rewrite; every part trains (each
in its own worker group of two ranks) and publishes its own weights versions; the iteration's flow
run shows each part's generate, train and sync as task runs of their own; the composed shards
open with plain pyarrow; the same run with every part in one worker group (`compose.placement:
shared`), killed with SIGKILL mid-iteration, resumes to the uninterrupted run's metrics and every
part's weights."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.composed_runs import composed_rollouts, killed_and_resumed, reference_run

pytestmark = pytest.mark.slow

TEXT = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64, "charset": "abcdefghijklmnopqrstuvwxyz "}
PARTS = ("rewriter", "polisher", "drawer")
RECIPE = {
    "name": "pe-e2e", "data": {"name": "geneval", "heldout_size": 2},
    "reward": {"scorers": [{"name": "brightness"}]},  # varies on random models: both sides get a signal
    "compose": {"kind": "pipeline", "parts": [
        {"name": "rewriter", "model": {"kind": "qwen3", "tiny": TEXT}, "algorithm": {"name": "grpo"},
         "rollout": {"prompts_per_iteration": 1, "group_size": 2, "max_new_tokens": 4},
         "train": {"micro_batch_size": 4, "nproc_per_node": 2}},
        {"name": "polisher", "model": {"kind": "qwen3", "tiny": {**TEXT, "seed": 1}}, "algorithm": {"name": "grpo"},
         "rollout": {"group_size": 2, "max_new_tokens": 4}, "train": {"micro_batch_size": 4, "nproc_per_node": 2}},
        {"name": "drawer", "model": {"kind": "sd3", "tiny": {"image_size": 16}}, "algorithm": {"name": "flow_grpo"},
         "rollout": {"group_size": 2, "sampler": {"num_steps": 3, "init_same_noise": False}},
         "train": {"micro_batch_size": 4, "nproc_per_node": 2}},
    ]},
    "eval": {"k": 2}, "iterations": 3, "checkpoint_every": 1,
}


def weights_files(run: Path, side: str, version: int) -> dict:
    return json.loads((run / "parts" / side / "weights" / f"v{version:06d}" / "manifest.json").read_text())["files"]


@pytest.fixture(scope="module")
def pe_reference(tmp_path_factory, prefect_server, mlflow_uri):
    """One uninterrupted pipeline run of three iterations."""
    return reference_run(tmp_path_factory.mktemp("pe-reference"), prefect_server, mlflow_uri, RECIPE, "pe-reference")


def test_a_pipeline_run_trains_every_part_and_shows_each(pe_reference, prefect_server, mlflow_uri):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    run, _, out = pe_reference
    assert "iter-000002 (3/3)" in out.stdout and "held-out v000003 (after RL)" in out.stdout
    composed = composed_rollouts(run, rows=1 * 2 * 2 * 2, parts=PARTS)  # prompts x rewrites x polished x images
    for side in PARTS:
        train = json.loads((run / "parts" / side / "iter-000002" / "train.json").read_text())["metrics"]
        assert train["grad_norm"] > 0 and train["behaviour_logp_max_abs_diff"] < 1e-4, side  # replay against the sampler's record
        assert weights_files(run, side, 3) != weights_files(run, side, 0), side  # each side published its own versions
    metrics = json.loads((run / "iter-000002" / "_SUCCESS").read_text())["metrics"]
    assert {f"{kind}/{side}/{key}" for side in PARTS for kind, key in (("train", "loss"), ("advantage", "abs_mean"))} <= set(metrics)
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert "images/rollouts/step-000002.png" in [a.path for a in client.list_artifacts(info["mlflow_run_id"], "images/rollouts")]
    shown = json.loads(Path(client.download_artifacts(info["mlflow_run_id"], "tables/rewrites/step-000002.json")).read_text())
    rows = [dict(zip(shown["columns"], r)) for r in shown["data"]]
    by_id = {r["sample_id"]: r for r in composed.to_pylist()}
    assert len(rows) == 8 and all(r["rewrite"] == by_id[r["sample_id"]]["polisher/text"] for r in rows)  # the last text beside its image
    versions = {side: sorted(int(v.tags["unirl.policy_version"]) for v in client.search_model_versions(f"name='pe-e2e-{side}'")
                             if v.tags.get("unirl.run") == "pe-reference") for side in PARTS}
    assert versions == dict.fromkeys(PARTS, [0, 1, 2, 3])  # each part's published versions, registered
    with prefect_server.client() as c:
        iterations = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pe-iteration"])),
                                      flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:pe-reference"])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in iterations])))
    assert sorted(r.name for r in iterations) == [f"pe-reference/iter-{i:06d}" for i in range(3)]
    names = {t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id == iterations[0].id}
    assert {"compose", "score", "advantage", *(f"{task}-{side}" for task in ("generate", "train", "sync") for side in PARTS)} <= names


def test_a_killed_pipeline_run_in_one_worker_group_resumes_to_the_uninterrupted_results(pe_reference, tmp_path, unirl_env):
    reference, recipe, _ = pe_reference

    def stopped(run: Path) -> None:  # iteration 1: the rewriter trained, its sync under way, the others not yet trained
        assert (run / "parts" / "rewriter" / "iter-000001" / "manifests" / "train.json").exists()
        for later in PARTS[1:]:
            assert not (run / "parts" / later / "iter-000001" / "manifests" / "train.json").exists()

    run, out = killed_and_resumed(recipe, "pe-reference", tmp_path / "runs", unirl_env, workers_at_least=3, stopped=stopped,
                                  overrides=("compose.placement=shared",))
    # One group of two ranks holds every part; each comes back from a checkpoint of its own, never
    # from the initial weights: the rewriter from version 2 (its sync of iteration 1 had saved it
    # before the kill) or, where another member asked first, from version 1 and a replay of
    # iteration 1's train step; the others from version 1 (their iteration 1 had not trained).
    # The group's news goes to the console and the run's log (a group started while no task of the
    # flow runs may miss the log), so both are read; a failure shows every line of that news.
    logs = "".join(p.read_text() for p in sorted((run / "logs").glob("*.log"))) + out.stdout + out.stderr
    news = [line for line in logs.splitlines() if "worker group" in line or "checkpoint" in line or "replaying" in line]
    started = re.findall(r"starting worker group: 2 rank\(s\), members rewriter at checkpoint (\d+), polisher at "
                         r"checkpoint 1, drawer at checkpoint 1", logs)
    assert started and set(started) <= {"1", "2"}, news
    if "2" not in started:
        assert "replaying the train step of iter-000001 from storage" in logs, news
    for i in range(3):
        a = json.loads((run / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        b = json.loads((reference / f"iter-{i:06d}" / "_SUCCESS").read_text())["metrics"]
        for key in ("rollout/reward_mean", *(f"train/{side}/{k}" for side in PARTS for k in ("loss", "grad_norm"))):
            assert a[key] == b[key], (i, key)
    for side in PARTS:
        assert weights_files(run, side, 3) == weights_files(reference, side, 3), side

"""On-policy distillation through the real CLI on a Prefect server: two teachers SFT-trained at the
run's start (a task run each), a two-domain student distilled from them (a `teacher-<name>` task
run per teacher and iteration), killed with SIGKILL mid-distillation (iteration 1's teacher work
done, not committed) and resumed by the same command: the run ends with the uninterrupted run's metrics,
MLflow history and weights, to the bit, each iteration committed once, and `unirl audit` passes."""
from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import REPO, run_unirl

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "distill" / "quickstart.yaml"
SMALL = ["iterations=3", "checkpoint_every=2", "eval.enabled=false", "sft.steps=10", "sft.examples=200",
         "distill.teachers.0.sft.steps=20", "distill.teachers.1.sft.steps=20", "distill.teachers.0.sft.examples=200",
         "distill.teachers.1.sft.examples=200", "rollout.prompts_per_iteration=4", "rollout.group_size=4",
         "model.tiny={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, "
         "intermediate_size: 64}", "tracking.registry=false"]
KILLS = ["teacher@1"]


def test_a_distillation_run_killed_mid_distillation_resumes_to_the_uninterrupted_results(tmp_path, unirl_env, prefect_server):
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        FlowRunFilterTags,
    )

    from tests.e2e.faults_bench import faults
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    args = ["run", str(RECIPE), *SMALL, f"storage.root={root}"]
    ref = run_unirl([*args, "--run-name", "ref"], unirl_env)
    assert "[unirl] teacher add: SFT on arithmetic (20 steps)" in ref.stdout and "rkl " in ref.stdout, ref.stdout
    said = []
    for fault in KILLS:
        killed = run_unirl([*args, "--run-name", "killed"], {**unirl_env, "UNIRL_FAULTS": fault}, check=False)
        assert killed.returncode == -signal.SIGKILL, f"{fault}: not killed at its fault point\n{killed.stderr[-3000:]}"
        said.append(killed.stdout)
        report = audit_run(RunStorage(str(root), "killed"))
        assert report.ok, f"after {fault}:\n{report.text()}"
    resumed = run_unirl([*args, "--run-name", "killed"], unirl_env)
    said.append(resumed.stdout)
    assert sum("teacher add: SFT" in out for out in said) == 1  # trained once, then reused
    assert "rkl " in said[0] and "iter-000001" not in said[0]  # killed in iteration 1's teacher stage
    done = [line.split()[1] for out in said for line in out.splitlines() if line.startswith("[unirl] iter-")]
    assert done == [f"iter-{i:06d}" for i in range(3)], said
    a, b = (faults.snapshot(root / name, unirl_env, 3) for name in ("killed", "ref"))
    assert faults.differences(a, b) == []
    history = a["mlflow"]
    assert {"rollout/add/reward_mean", "rollout/sub/reward_mean", "distill/add/reverse_kl", "distill/sub/reverse_kl"} <= set(history)
    assert [step for step, _ in history["distill/add/reverse_kl"]] == [0, 1, 2]
    for i in range(3):
        run = root / "killed" / f"iter-{i:06d}"
        for teacher in ("add", "sub"):
            manifest = json.loads((run / "manifests" / f"teacher-{teacher}.json").read_text())
            assert manifest["rows"] == 8 and manifest["teacher"] == teacher  # 2 prompts x 4 samples of its domain
    report = audit_run(RunStorage(str(root), "killed"))
    assert report.ok and report.committed == [0, 1, 2], report.text()
    with prefect_server.client() as c:
        iterations = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-iteration"])),
                                      flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:ref"])))
        run = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-train"])),
                               flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["distill/ref"])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in [*iterations, *run]])))
    names = [t.name for t in tasks]
    assert names.count("teacher-add") == 3 and names.count("teacher-sub") == 3, names
    assert names.count("teacher-sft-add") == 1 and names.count("teacher-sft-sub") == 1, names

"""Async RL through the real CLI: the rl-producer flow in its own process samples ahead on the
engine server while the trainer trains, under max_staleness 1. A kill of either side resumes with
nothing lost or trained twice: the producer SIGKILLed as it commits iteration 1's batch (the
trainer starts it again), and the trainer SIGKILLed in iteration 1's train stage (rerun) end at
the same final weights, each iteration trained once on rows of the scheduled version."""
from __future__ import annotations

import json

import pyarrow.ipc as ipc
import pytest

from tests.conftest import TINY, run_unirl

pytestmark = pytest.mark.slow

ASYNC = ["run", str(TINY), "iterations=3", "reward.scorers=[{name: integer_format}]", "rollout.engine.name=engine_server",
         "rollout.mode=async", "rollout.max_staleness=1", "rollout.correction={}", "eval.enabled=false",
         "checkpoint_every=1"]


def final_weights(run) -> dict:
    return {k: v["sha256"] for k, v in json.loads((run / "weights/v000003/manifest.json").read_text())["files"].items()}


def test_a_killed_producer_or_trainer_loses_nothing(tmp_path, unirl_env):
    root = tmp_path / "runs"
    out = run_unirl([*ASYNC, f"storage.root={root}", "--run-name", "producer-killed"],
                    {**unirl_env, "UNIRL_FAULTS": "produce@1"})
    assert "producer (pid" in out.stderr + out.stdout and "starting it again" in out.stderr + out.stdout
    killed = run_unirl([*ASYNC, f"storage.root={root}", "--run-name", "trainer-killed"], {**unirl_env, "UNIRL_FAULTS": "train@1"},
                       check=False)
    assert killed.returncode != 0 and not (root / "trainer-killed/iter-000001/_SUCCESS").exists()
    run_unirl([*ASYNC, f"storage.root={root}", "--run-name", "trainer-killed"], unirl_env)
    for name in ("producer-killed", "trainer-killed"):
        run = root / name
        for i in range(3):
            produced = json.loads((run / f"iter-{i:06d}/manifests/produce.json").read_text())
            assert produced["policy_version"] == max(0, i - 1)  # the schedule: version k - max_staleness
            rows = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all()
            assert set(rows.column("policy_version").to_pylist()) == {max(0, i - 1)}
            gen = json.loads((run / f"iter-{i:06d}/manifests/generate.json").read_text())
            assert gen["metrics"]["rollout/stale_groups_dropped"] == 0
            train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
            assert train["stale_frac"] == (0.0 if i == 0 else 1.0) and "is_weight_mean" in train
    assert final_weights(root / "producer-killed") == final_weights(root / "trainer-killed")
    for i in range(3):
        a = json.loads((root / f"producer-killed/iter-{i:06d}/train.json").read_text())["metrics"]
        b = json.loads((root / f"trainer-killed/iter-{i:06d}/train.json").read_text())["metrics"]
        assert a["loss"] == b["loss"] and a["is_weight_mean"] == b["is_weight_mean"]

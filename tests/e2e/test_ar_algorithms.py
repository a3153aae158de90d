"""The AR track's algorithms and options end to end through the CLI, each on a tiny budget:
SFT warm start -> GRPO / GSPO / DRPO, LoRA with the adapter-disabled reference and KL, EMA,
cosine schedule, two updates per batch, DAPO dynamic sampling; resume restores the schedule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, run_unirl

pytestmark = pytest.mark.slow

SMALL = ["sft.steps=20", "sft.examples=200", "iterations=2", "rollout.prompts_per_iteration=4", "eval.k=2", "data.heldout_size=8"]


def train_metrics(run: Path, i: int) -> dict:
    return json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]


@pytest.mark.parametrize("recipe", ["gspo", "drpo"])
def test_algorithm_recipes_run(recipe, tmp_path, unirl_env):
    root = tmp_path / "runs"
    out = run_unirl(["run", str(REPO / f"recipes/ar/{recipe}.yaml"), f"storage.root={root}", *SMALL], unirl_env)
    assert "held-out v000000 (before RL)" in out.stdout and "held-out v000002 (after RL)" in out.stdout
    run = root / recipe
    for i in range(2):
        m = train_metrics(run, i)
        signal = json.loads((run / f"iter-{i:06d}/manifests/advantage.json").read_text())["metrics"]["advantage/abs_mean"]
        assert 0.0 <= m["behaviour_logp_max_abs_diff"] <= 1e-4  # the trainer's replay vs the sampler's record
        assert (m["grad_norm"] > 0) == (signal > 0), (m, signal)
    # the SFT output is a plain HF folder: a valid model.path for another recipe
    assert (run / "weights/v000000/config.json").is_file()
    assert json.loads((run / "eval/v000002/metrics.json").read_text())["metrics"]["eval/prompts"] == 8.0


def test_lora_kl_ema_cosine_two_updates_dynamic_sampling(tmp_path, unirl_env):
    root = tmp_path / "runs"
    args = [
        "run", str(REPO / "recipes/ar/quickstart.yaml"), f"storage.root={root}", *SMALL,
        "model.lora={rank: 4, alpha: 8}", "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k2",
        "train.ema={decay: 0.9}", "train.lr_schedule=cosine", "train.warmup_steps=1", "train.updates_per_batch=2",
        "rollout.dynamic_sampling={max_rounds: 2}", "checkpoint_every=1",
    ]
    run_unirl(args, unirl_env)
    run = root / "quickstart"
    m0, m1 = train_metrics(run, 0), train_metrics(run, 1)
    assert m0["behaviour_logp_max_abs_diff"] <= 1e-4 and "kl" in m0
    # cosine over 2 iterations x 2 updates with 1 warm-up step: lr factors 1/1... last step at progress 2/3
    assert m1["lr"] < m0["lr"]
    assert (run / "weights/v000002/ema/model.safetensors").is_file()
    merged = load_file(str(run / "weights/v000002/model.safetensors"))
    assert not any("lora" in k for k in merged), "published LoRA weights must be merged into a plain model"
    adv = json.loads((run / "iter-000000/manifests/advantage.json").read_text())["metrics"]
    assert adv["rollout/dynamic_rounds"] >= 1.0
    # Resume past the end: checkpoint 2 restores optimizer, schedule position and EMA.
    out = run_unirl([*args[:-1], "checkpoint_every=1", "iterations=3"], unirl_env)
    assert "iter-000002 (3/3)" in out.stdout
    extra = json.loads((run / "checkpoints/000003/extra.json").read_text())
    assert extra["worker"]["opt_steps"] == 6


def test_bad_inputs_fail_before_training(tmp_path, unirl_env):
    root = tmp_path / "runs"
    base = ["run", str(REPO / "recipes/ar/quickstart.yaml"), f"storage.root={root}", *SMALL]
    out = run_unirl([*base, "model.lora={rank: 4, target_modules: [nope_proj]}", "--run-name", "lora"], unirl_env, check=False)
    assert out.returncode == 1 and "match no linear layer" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    out = run_unirl([*base, f"model.path={empty}", "--run-name", "noweights"], unirl_env, check=False)
    assert out.returncode == 1 and "no weights" in out.stderr and str(empty) in out.stderr
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    out = run_unirl([*base, "data={name: file, path: " + str(data) + "}", "--run-name", "nocol"], unirl_env, check=False)
    assert out.returncode != 0 and "answer" in out.stderr and "solution" in out.stderr
    data.write_text("")
    out = run_unirl([*base, "data={name: file, path: " + str(data) + "}", "--run-name", "empty"], unirl_env, check=False)
    assert out.returncode != 0 and "empty" in out.stderr.lower()

"""Off-policy correction (docs/architecture.md, "The math contract") on hand-computed tensors, and through the algorithm
seam: the weighted loss is the kernel's loss times the weights, metrics are reported, the recipe
refuses what an algorithm cannot take."""
from __future__ import annotations

import math

import pytest
import torch

from tests.tiny import TINY, merged
from unirl.stages.algorithms.correction import CorrectionConfig
from unirl.stages.kernels.correction import importance_weights, weighted_advantage
from unirl.stages.kernels.token_losses import grpo_loss
from unirl.stages.recipe import RecipeError, build_recipe

# proximal o, behaviour b over two sequences of three tokens, the last token of row 1 padding
O = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])  # noqa: E741 - the contract's names
B = torch.tensor([[-1.0, -3.0, -0.2], [-1.0, -1.0, 5.0]])
M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_truncation_by_hand():
    w, m = importance_weights(O, B, M, level="token", mode="truncate", cap=2.0)
    # exp(o - b): [1, e^1, e^-0.3], [e^0.7, e^-0.2, (pad)] -> capped at 2
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.3)], [2.0, math.exp(-0.2), 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["is_truncated_frac"] == pytest.approx(2 / 5)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_weight_min"] == pytest.approx(math.exp(-0.3))
    assert m["is_weight_mean"] == pytest.approx(float(expected.sum()) / 5)
    assert not w.requires_grad


def test_sequence_weights_and_masking_by_hand():
    w, m = importance_weights(O, B, M, level="sequence", mode="truncate", cap=2.0)
    # row 0: sum = 0 + 1 - 0.3 = 0.7 -> e^0.7 = 2.01 -> 2; row 1: 0.7 - 0.2 = 0.5 (padding ignored)
    torch.testing.assert_close(w, torch.tensor([2.0, math.exp(0.5)]))
    assert m["is_truncated_frac"] == pytest.approx(0.5)
    w, m = importance_weights(O, B, M, level="token", mode="mask", cap=2.0)
    # band [0.5, 2]: e^1 = 2.72 and e^0.7 = 2.01 leave it and are dropped; the rest keep their ratio
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, math.exp(-0.3)], [0.0, math.exp(-0.2), 0.0]]))
    assert m["is_masked_frac"] == pytest.approx(2 / 5)
    w, _ = importance_weights(O, B, M, level="token", mode="mask", cap=2.0, band=(0.9, 3.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, math.e, 0.0], [math.exp(0.7), 0.0, 0.0]]))


def test_weighting_the_advantage_weights_each_tokens_loss():
    """grpo_loss is positively homogeneous in A, so the kernel on w*A is the per-token loss times w."""
    logp = torch.tensor([[-0.9, -2.2, -0.4], [-0.2, -1.3, 0.0]], requires_grad=True)
    adv = torch.tensor([1.5, -0.7])
    w, _ = importance_weights(O, B, M, level="token", mode="truncate", cap=2.0)
    got = grpo_loss(logp, O, weighted_advantage(adv, w), M, clip_low=0.2, clip_high=0.28).loss
    r = torch.exp(logp - O)
    per_token = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None]) * w
    torch.testing.assert_close(got, (per_token * M).sum() / M.sum())
    seq_w, _ = importance_weights(O, B, M, level="sequence", mode="truncate", cap=2.0)
    assert weighted_advantage(adv, seq_w).shape == (2,)


def test_recipe_rules():
    base = merged(TINY["qwen3"], {"rollout": {"engine": {"name": "engine_server"}}})
    with pytest.raises(RecipeError, match=r"rollout.correction.level: algorithm 'gspo' takes sequence-level correction, "
                                          r"not 'token'"):
        build_recipe(merged(base, {"algorithm": {"name": "gspo"}, "rollout": {"correction": {}}}))
    build_recipe(merged(base, {"algorithm": {"name": "gspo"}, "rollout": {"correction": {"level": "sequence"}}}))
    with pytest.raises(RecipeError, match="rollout.correction.mode: truncated importance sampling corrects"):
        build_recipe(merged(base, {"rollout": {"correction": {"objective": "behaviour"}}}))
    with pytest.raises(RecipeError, match=r"rollout.correction: with rollout.engine.sync.every 2 rows are sampled by older"):
        build_recipe(merged(base, {"rollout": {"engine": {"sync": {"every": 2}}}}))
    with pytest.raises(RecipeError, match="rollout.mode: async samples on a dedicated engine"):
        build_recipe(merged(TINY["qwen3"], {"rollout": {"mode": "async", "correction": {}}}))
    assert CorrectionConfig(mode="mask", cap=4.0).limits == (0.25, 4.0)


def test_stale_rows_are_corrected_and_measured_fresh_rows_still_checked(tmp_path, tiny_weights):
    """Through the seam: a batch whose rows an older policy sampled trains with the correction and
    reports the mismatch; the same rows stamped as fresh fail the on-policy check."""
    from unirl.stages.algorithms import BehaviourMismatchError
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    recipe = build_recipe(merged(TINY["qwen3"], {"storage": {"root": str(tmp_path)},
                                                 "rollout": {"correction": {"mode": "mask", "cap": 1.5}}}))
    storage = RunStorage(str(tmp_path), "run")
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "run",
            "weights_dir": str(tiny_weights("qwen3")), "scratch": str(tmp_path / "scratch")}
    w = Worker(spec, None, torch.device("cpu"))
    gen = w.generate(iteration=0, requests=it.write_requests(storage, recipe, 0)["files"][0], out_dir="iter-000000/rollouts")
    rows = read_shard(storage, gen["files"][0], "rollouts").to_pylist()
    for r in rows:  # an older policy's record: every behaviour log-prob shifted
        r["response_logprobs"] = [lp - 0.3 * (k % 2) for k, lp in enumerate(r["response_logprobs"])]
    for version, name in ((-1, "stale"), (0, "fresh")):
        for r in rows:
            r["policy_version"] = version
        write_shard(storage, f"{name}.arrow", table_from_rows(rows, "rollouts", ["text"]))
    adv = it.advantages(storage, recipe, 0, it.score(storage, recipe, 0, [gen["files"][0]])["files"])["files"][0]
    with pytest.raises(BehaviourMismatchError, match="differs from the log-probs recorded at sampling time by 0.3"):
        w.train(iteration=0, rollouts=["fresh.arrow"], advantages=adv)
    w.stack.optimizer.zero_grad(set_to_none=True)
    m = w.train(iteration=0, rollouts=["stale.arrow"], advantages=adv)["metrics"]
    assert m["stale_frac"] == 1.0
    assert m["behaviour_logp_max_abs_diff"] == pytest.approx(0.3, abs=1e-4)
    # tokens shifted by 0.3 have weight e^0.3 = 1.35, inside [1/1.5, 1.5]: none masked
    assert m["is_masked_frac"] == 0.0 and m["is_weight_max"] == pytest.approx(math.exp(0.3), abs=1e-3)

"""The off-policy correction of the flow policies (stages/algorithms/flow_likelihood.py,
stages/kernels/correction.py; docs/diffusion.md, "Off-policy rows"): per SDE step the importance
weight w_j = exp(o_j - b_j) of the proximal policy's step log-prob o_j over the behaviour policy's
b_j, truncated at C or masked outside the band, multiplies that step's loss.

Hand-computed: weight 1 on-policy; for two Gaussian transitions of one scale s the weight is
exp(mean over elements of ((x' - m_b)^2 - (x' - m_p)^2) / (2 s^2)); truncation and masking at
their bounds; the weighted Flow-GRPO and Flow-DPPO losses. Through the engine server with
`sync.every: 2`, rows an older version sampled train under the correction."""
from __future__ import annotations

import math

import pytest
import torch

from unirl.stages.diffusion.sde import sde_step
from unirl.stages.kernels.correction import importance_weights
from unirl.stages.kernels.flow_losses import flow_dppo_loss, flow_grpo_loss

# DanceGRPO's kernel at sigma 0.5 -> 0.25 with eta 0.2: std = 0.2, dt = -0.25, scale = std * sqrt(-dt) = 0.1;
# mean = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt = 0.99 x - 0.255 v
STEP = {"sigma": 0.5, "sigma_next": 0.25, "eta": 0.2, "sigma_max": 0.9}


def step_logp(v: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    out = sde_step("dance", torch.zeros_like(v), v, STEP["sigma"], STEP["sigma_next"], eta=STEP["eta"],
                   sigma_max=STEP["sigma_max"], prev_sample=prev).log_prob
    assert out is not None
    return out


def test_a_step_the_same_weights_sampled_weighs_one():
    v = torch.tensor([[0.3, -0.7, 0.1]])
    out = sde_step("dance", torch.zeros_like(v), v, STEP["sigma"], STEP["sigma_next"], eta=STEP["eta"],
                   sigma_max=STEP["sigma_max"], generator=torch.Generator().manual_seed(0))
    again = step_logp(v, out.prev_sample)
    assert out.log_prob is not None
    w, stats = importance_weights(again[:, None], out.log_prob[:, None], torch.ones(1, 1), level="token", mode="truncate", cap=2.0)
    assert w.tolist() == [[1.0]] and stats["is_truncated_frac"] == 0.0


def test_the_weight_is_the_ratio_of_the_two_gaussian_steps():
    """x' = (0.3, -0.1); the behaviour mean (0.2, 0.0), the proximal (0.25, -0.05), scale 0.1: each
    element ((0.1)^2 - (0.05)^2) / 0.02 = 0.375, so w = e^0.375 = 1.45499..."""
    prev = torch.tensor([[0.3, -0.1]])
    m_b, m_p = torch.tensor([[0.2, 0.0]]), torch.tensor([[0.25, -0.05]])
    b, o = step_logp(m_b / -0.255, prev), step_logp(m_p / -0.255, prev)
    assert float(o - b) == pytest.approx(0.375, abs=1e-5)
    ones = torch.ones(1, 1)
    raw, _ = importance_weights(o[:, None], b[:, None], ones, level="token", mode="truncate", cap=10.0)
    assert float(raw) == pytest.approx(math.exp(0.375), rel=1e-5)
    capped, stats = importance_weights(o[:, None], b[:, None], ones, level="token", mode="truncate", cap=1.2)
    assert float(capped) == pytest.approx(1.2) and stats["is_truncated_frac"] == 1.0
    dropped, stats = importance_weights(o[:, None], b[:, None], ones, level="token", mode="mask", cap=1.25)
    assert float(dropped) == 0.0 and stats["is_masked_frac"] == 1.0  # outside [0.8, 1.25]
    kept, _ = importance_weights(o[:, None], b[:, None], ones, level="token", mode="mask", cap=2.0)
    assert float(kept) == pytest.approx(math.exp(0.375), rel=1e-5)


def test_truncation_and_masking_at_their_bounds():
    """log-ratios ln 2, -ln 2, ln 3: at the cap 2 a weight is kept as it is (w > C truncates), and
    the band [1/2, 2] keeps both its ends."""
    o = torch.log(torch.tensor([[2.0, 0.5, 3.0]]))
    b = torch.zeros(1, 3)
    w, stats = importance_weights(o, b, torch.ones(1, 3), level="token", mode="truncate", cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 2.0]) and stats["is_truncated_frac"] == pytest.approx(1 / 3)
    w, stats = importance_weights(o, b, torch.ones(1, 3), level="token", mode="mask", cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 0.0]) and stats["is_masked_frac"] == pytest.approx(1 / 3)


def test_the_weighted_flow_losses():
    """On the anchor (r = 1), A = (1, -2): Flow-GRPO's per-step losses are -A r = (-1, 2), mean 0.5;
    with weights (0.5, 2): (-0.5, 4), mean 1.75. Flow-DPPO drops nothing at r = 1: the same."""
    logp = torch.zeros(2, 1, requires_grad=True)
    adv, w = torch.tensor([1.0, -2.0]), torch.tensor([[0.5], [2.0]])
    assert float(flow_grpo_loss(logp, logp.detach(), adv).loss.detach()) == pytest.approx(0.5)
    assert float(flow_grpo_loss(logp, logp.detach(), adv, weights=w).loss.detach()) == pytest.approx(1.75)
    mean = torch.zeros(2, 1, 3)
    assert float(flow_dppo_loss(logp, logp.detach(), adv, mean, mean, 0.1, weights=w).loss.detach()) == pytest.approx(1.75)
    out = flow_grpo_loss(logp, logp.detach(), adv, weights=w)
    out.loss.backward()  # d/dlogp of w * (-A r) / 2 at r = 1: -w A / 2
    assert logp.grad[:, 0].tolist() == pytest.approx([-0.25, 2.0])
    with pytest.raises(ValueError, match=r"weights must be \(B, S\) = \(2, 1\)"):
        flow_grpo_loss(logp, logp.detach(), adv, weights=torch.ones(2))


@pytest.mark.slow  # an engine server and two flow iterations: about 10 s
def test_rows_an_older_version_sampled_train_under_the_correction(tmp_path):
    """sd3 Flow-GRPO on the engine server with `sync.every: 2` and a truncated correction:
    iteration 1 is sampled by version 0 (no sync after the first update) and trained at version 1.
    Its rows are not held to their record (they are another version's), their steps are weighted,
    and the first iteration's on-policy rows still replay bit for bit."""
    from tests.stages.engines.test_engine_sync import LocalTrainer, setup
    from unirl.stages.run import iteration as it

    recipe, storage, worker, engine = setup(tmp_path, "sd3", sync={"every": 2}, recipe={
        "algorithm": {"name": "flow_grpo"}, "train": {"lr": 0.05}, "rollout": {"correction": {"cap": 2.0}}})
    try:
        metrics = []
        for iteration in (0, 1):
            req = it.write_requests(storage, recipe, iteration)["files"][0]
            gen = engine.generate(req, f"iter-{iteration:06d}/rollouts", iteration, 0)
            adv = it.advantages(storage, recipe, iteration, it.score(storage, recipe, iteration, gen["files"])["files"])["files"][0]
            metrics.append(worker.train(iteration=iteration, rollouts=gen["files"], advantages=adv)["metrics"])
            synced = engine.sync(LocalTrainer(worker), iteration + 1)
            assert (synced == {}) == (iteration == 0)  # version 1 is not loaded (every 2), version 2 is
        fresh, stale = metrics
        assert fresh["behaviour_logp_max_abs_diff"] == 0.0 and fresh["stale_frac"] == 0.0 and fresh["is_weight_mean"] == 1.0
        assert stale["stale_frac"] == 1.0 and stale["behaviour_logp_abs_diff"] > 0  # version 1 replays version 0's rows
        assert 0 < stale["is_weight_min"] <= stale["is_weight_max"] <= 2.0 and stale["is_weight_mean"] != 1.0
    finally:
        engine.close()


def test_validate_takes_a_flow_run_on_older_rows_only_with_a_correction():
    from tests.tiny import TINY, merged
    from unirl.stages.recipe import build_recipe

    base = merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}, "rollout": {"engine": {"name": "engine_server", "sync": {"every": 2}}}})
    with pytest.raises(ValueError, match=r"rollout.correction: with rollout.engine.sync.every 2"):
        build_recipe(base)
    build_recipe(merged(base, {"rollout": {"correction": {}}}))
    with pytest.raises(ValueError, match=r"rollout.correction.level: algorithm 'flow_grpo' takes token-level correction"):
        build_recipe(merged(base, {"rollout": {"correction": {"level": "sequence"}}}))
    with pytest.raises(ValueError, match=r"algorithm 'nft' trains on-policy only"):
        build_recipe(merged(base, {"algorithm": {"name": "nft"}, "rollout": {"correction": {}}}))

"""Flow-matching RL losses against hand-computed values from docs/architecture.md, "The math contract"."""
from __future__ import annotations

import math

import pytest
import torch

from unirl.stages.kernels.aggregate import LossOutput
from unirl.stages.kernels.flow_losses import flow_dppo_loss, flow_grpo_loss, nft_loss
from unirl.stages.kernels.kl import flow_kl


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------- flow_grpo


def test_flow_grpo_by_hand():
    # ratios (1.5, .5 | 1.00005, 1), adv (2, -10) -> A = (2, -5) after adv_clip 5, eps = .2:
    #   r=1.5,  A=2 : max(-3, -2*1.2) = -2.4          (clipped high)
    #   r=.5,   A=2 : max(-1, -2*.8) = -1
    #   r=1.00005, A=-5: 5.00025 (inside the range)
    #   r=1,    A=-5: 5
    # loss = (-2.4 - 1 + 5.00025 + 5) / 4 = 1.6500625
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.00005), 0.0]], requires_grad=True)
    out = flow_grpo_loss(logp, torch.zeros(2, 2), torch.tensor([2.0, -10.0]), clip_range=0.2)
    assert isinstance(out, LossOutput) and out.loss.dim() == 0
    close(out.loss, 1.6500625)
    assert out.metrics["clip_frac"] == pytest.approx(0.25)
    assert out.metrics["clip_frac_high"] == pytest.approx(0.25)
    assert out.metrics["ratio_max"] == pytest.approx(1.5)
    assert out.metrics["ratio_min"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0000125, abs=1e-6)
    # approx_kl = mean(log r^2)/2 = (.1644019 + .4804530 + 2.5e-9 + 0) / 8
    assert out.metrics["approx_kl"] == pytest.approx(0.0806069, abs=1e-6)
    out.loss.backward()
    # d/dlogp of -A*r/4 = -A*r/4: (0 clipped, -.25 | 1.2500625, 1.25)
    close(logp.grad, [[0.0, -0.25], [1.2500625, 1.25]], atol=1e-5)


def test_flow_grpo_on_policy_ratio_is_one():
    logp = torch.randn(3, 4)
    out = flow_grpo_loss(logp, logp.clone(), torch.tensor([1.0, -0.5, 7.0]))
    close(out.loss, -(1.0 - 0.5 + 5.0) / 3)  # adv 7 clipped to 5, r = 1 everywhere
    assert out.metrics["ratio_min"] == out.metrics["ratio_max"] == 1.0
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["approx_kl"] == 0.0


def test_flow_grpo_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"adv must be \(B,\)"):
        flow_grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"logp must be \(B, S\)"):
        flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2))


def test_flow_kl_by_hand():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    # row 0, std 1: (1/2 + 4/2)/2 = 1.25; row 1, std .5: (0 + 1/(2*.25))/2 = 1.0
    close(flow_kl(mean, ref, torch.tensor([1.0, 0.5])), [1.25, 1.0])
    close(flow_kl(mean, ref, 1.0), [1.25, 0.25])
    images = torch.zeros(2, 1, 2, 2)
    close(flow_kl(images + 0.5, images, torch.tensor([0.5, 1.0])), [0.5, 0.125])


# ---------------------------------------------------------------- flow_dppo


def test_flow_dppo_drop_rule_truth_table():
    # One step per sample (S = 1). k = mean over (.., 2) of diff^2/2 with std 1:
    # diff (.01, 0) -> k = 2.5e-5 >= 1e-5 (moved); diff (.001, 0) -> 2.5e-7 (not moved).
    up, down, even = math.log(2.0), math.log(0.5), 0.0
    rows = [  # (log r, A, moved, dropped, loss term -A*r unless dropped)
        (up, 1.0, True, True, 0.0),      # r>1, A>0, moved: drop
        (down, -1.0, True, True, 0.0),   # r<1, A<0, moved: drop
        (up, -1.0, True, False, 2.0),    # moving against A: keep
        (down, 1.0, True, False, -0.5),
        (even, 1.0, True, False, -1.0),  # r == 1: keep
        (up, 1.0, False, False, -2.0),   # not moved: keep
        (down, -1.0, False, False, 0.5),
        (up, 0.0, True, False, 0.0),     # A == 0: keep
    ]
    logp = torch.tensor([[r[0]] for r in rows], requires_grad=True)
    adv = torch.tensor([r[1] for r in rows])
    old_mean = torch.zeros(len(rows), 1, 2)
    mean = torch.tensor([[[0.01 if r[2] else 0.001, 0.0]] for r in rows])
    out = flow_dppo_loss(logp, torch.zeros_like(logp), adv, mean, old_mean, 1.0, threshold=1e-5)
    close(out.loss, sum(r[4] for r in rows) / len(rows))  # -1/8
    close(out.loss, -0.125)
    assert out.metrics["drop_frac"] == pytest.approx(0.25)
    assert out.metrics["clip_frac_high"] == pytest.approx(0.125)
    assert out.metrics["clip_frac_low"] == pytest.approx(0.125)
    out.loss.backward()
    dropped = torch.tensor([r[3] for r in rows])
    assert bool((logp.grad[dropped] == 0).all())
    # kept rows: d(-A*r/8)/dlogp = -A*r/8
    close(logp.grad[~dropped].flatten(), [0.25, -0.0625, -0.125, -0.25, 0.0625, 0.0])


def test_flow_dppo_uses_per_step_std():
    # diff .001 with std .1: k = 1e-6/(2*.01)/2 = 2.5e-5 -> dropped; with std 1 it is kept.
    logp = torch.full((1, 2), math.log(2.0))
    mean = torch.tensor([[[0.001, 0.0], [0.001, 0.0]]])
    out = flow_dppo_loss(logp, torch.zeros(1, 2), torch.ones(1), mean, torch.zeros(1, 2, 2),
                         torch.tensor([[0.1, 1.0]]))
    assert out.metrics["drop_frac"] == pytest.approx(0.5)
    close(out.loss, (0.0 - 2.0) / 2)


# ---------------------------------------------------------------- nft


def _nft_batch():
    # sample 0: x0 = 0, xt = 1, t = .5, v_new = 2, v_old = 1, adv = 5  -> p = 1
    # sample 1: x0 = (1, -1), xt = (2, 0), t = 1, v_new = .5, v_old = 1, adv = -2.5 -> p = .25
    x0 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    xt = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    t = torch.tensor([0.5, 1.0])
    v_new = torch.tensor([[2.0, 2.0], [0.5, 0.5]], requires_grad=True)
    v_old = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    return x0, xt, t, v_new, v_old, torch.tensor([5.0, -2.5])


def test_nft_beta_one_by_hand():
    # beta 1: pos = v_new, neg = 2 v_old - v_new.
    # s0: x0p = 1 - .5*2 = 0 (mse 0, wp 1e-5); x0n = 1 - .5*0 = 1 (mse 1, wn 1)
    # s1: x0p = (1.5, -.5) (mse .25, wp .5); x0n = (2, 0) - 1.5 = (.5, -1.5) (mse .25, wn .5)
    # adaptive: mean(1*0 + 0*1, .25*.25/.5 + .75*.25/.5) = mean(0, .5) = .25 -> 5*.25/1 = 1.25
    x0, xt, t, v_new, v_old, adv = _nft_batch()
    out = nft_loss(x0, xt, t, v_new, v_old, adv, beta=1.0)
    close(out.loss, 1.25)
    assert out.metrics["pos_mse"] == pytest.approx(0.125)
    assert out.metrics["neg_mse"] == pytest.approx(0.625)
    assert out.metrics["p_mean"] == pytest.approx(0.625)
    # without adaptive weight: mean(0, .25*.25 + .75*.25) = .125 -> .625
    close(nft_loss(x0, xt, t, v_new, v_old, adv, beta=1.0, adaptive_weight=False).loss, 0.625)


def test_nft_beta_half_by_hand():
    # beta .5: pos = .5 v_new + .5 v_old, neg = 1.5 v_old - .5 v_new.
    # s0: pos 1.5 -> x0p = .25 (mse .0625, wp .25); neg .5 -> x0n = .75 (mse .5625, wn .75)
    # s1: pos .75 -> x0p = (1.25, -.75) (mse .0625, wp .25); neg 1.25 -> x0n = (.75, -1.25) (mse .0625, wn .25)
    # adaptive: mean(.0625/.25, .25*.25 + .75*.25) = .25 -> 5*.25/.5 = 2.5
    # fixed:    mean(.0625, .0625) = .0625 -> 5*.0625/.5 = .625
    x0, xt, t, v_new, v_old, adv = _nft_batch()
    close(nft_loss(x0, xt, t, v_new, v_old, adv, beta=0.5).loss, 2.5)
    close(nft_loss(x0, xt, t, v_new, v_old, adv, beta=0.5, adaptive_weight=False).loss, 0.625)


def test_nft_weights_are_detached_and_v_old_gets_no_gradient():
    x0, xt, t, v_new, _, adv = _nft_batch()
    v_old = torch.ones(2, 2, requires_grad=True)
    nft_loss(x0, xt, t, v_new, v_old, adv, beta=1.0).loss.backward()
    assert v_old.grad is None
    # Sample 1 with constant weights .5: d/dv_new of 5/2 * (.25*mse_p/.5 + .75*mse_n/.5),
    # x0p - x0 = (.5, .5) moves by -1 per unit v_new, x0n - x0 = (-.5, -.5) by +1:
    # per element: 5/2 * (.25/.5 * 2*.5*(-1) + .75/.5 * 2*(-.5)*(1)) / 2 = 5/2 * (-.5 - 1.5)/2 = -2.5
    close(v_new.grad[1], [-2.5, -2.5])


def test_nft_scalar_t_broadcasts_and_shapes_are_checked():
    x0, xt, _, v_new, v_old, adv = _nft_batch()
    per_sample = nft_loss(x0, xt, torch.tensor([0.5, 0.5]), v_new, v_old, adv).loss
    close(nft_loss(x0, xt, 0.5, v_new, v_old, adv).loss, per_sample.item())
    with pytest.raises(ValueError, match="beta > 0"):
        nft_loss(x0, xt, 0.5, v_new, v_old, adv, beta=0.0)
    with pytest.raises(ValueError, match="v_old has shape"):
        nft_loss(x0, xt, 0.5, v_new, v_old[:, :1], adv)

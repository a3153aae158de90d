import dataclasses
import math

import pytest
import torch

from unirl.stages.kernels.aggregate import LossOutput
from unirl.stages.kernels.kl import kl
from unirl.stages.kernels.token_losses import drpo_loss, grpo_loss, gspo_loss

METRIC_KEYS = {
    "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "ratio_max", "ratio_min",
}
LN = math.log


def close(actual, expected, tol=1e-5):
    assert actual == pytest.approx(expected, abs=tol), (actual, expected)


def on_policy_batch():
    """Two sequences of different lengths, logp == old_logp: every ratio is exactly 1."""
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -7.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, logp.clone(), adv, mask


# ---------------------------------------------------------------- kl

def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, 0.5])  # ref - logp = -0.5, 0, 1
    torch.testing.assert_close(kl(logp, ref, "k1"), torch.tensor([0.5, 0.0, -1.0]))
    torch.testing.assert_close(kl(logp, ref, "k2"), torch.tensor([0.125, 0.0, 0.5]))
    # exp(-.5) + .5 - 1 = 0.1065307; exp(0) - 0 - 1 = 0; e - 1 - 1 = 0.7182818
    torch.testing.assert_close(kl(logp, ref, "k3"), torch.tensor([0.1065307, 0.0, 0.7182818]))


def test_k3_and_k2_are_never_negative_and_keep_shape():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(4, 7, generator=g) * 3, torch.randn(4, 7, generator=g) * 3
    for name in ("k2", "k3"):
        out = kl(logp, ref, name)
        assert out.shape == (4, 7) and out.dtype == torch.float32
        assert (out >= 0).all()
    assert (kl(logp, ref, "k1") < 0).any()


def test_kl_rejects_unknown_estimator():
    with pytest.raises(ValueError, match=r"one of \('k1', 'k2', 'k3'\), got 'k4'"):
        kl(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------- grpo: aggregation

@pytest.mark.parametrize(
    ("agg", "horizon", "expected"),
    [
        # per-token l = -A: row 0 = [-1, -1, -1] (3 tokens), row 1 = [2] (1 token)
        ("token_mean", None, (-3 + 2) / 4),                   # -0.25
        ("seq_mean_token_mean", None, (-1 + 2) / 2),          # 0.5
        ("seq_mean_token_sum_norm", None, (-3 / 3 + 2 / 3) / 2),  # horizon = L = 3: -0.1667
        ("seq_mean_token_sum_norm", 4, (-3 / 4 + 2 / 4) / 2),     # -0.125
    ],
)
def test_on_policy_ratio_is_exactly_one_and_loss_is_minus_mean_advantage(agg, horizon, expected):
    out = grpo_loss(*on_policy_batch(), agg=agg, horizon=horizon)
    close(out.loss.item(), expected)
    assert out.metrics["ratio_min"] == 1.0 and out.metrics["ratio_max"] == 1.0
    assert out.metrics["ratio_mean"] == 1.0
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["approx_kl"] == 0.0


def clipped_batch():
    """Row 0: A = 1, ratios 1.1, 1.5, 0.5. Row 1: A = -1, ratios 0.5, 1.5 and one padded token."""
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[LN(1.1), LN(1.5), LN(0.5)], [LN(0.5), LN(1.5), 0.0]])
    logp = old + log_ratio
    logp[1, 2] = float("nan")  # padding may hold anything
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old, torch.tensor([1.0, -1.0]), mask


# With clip 0.2: row 0 l = -min(r, clip(r)) = [-1.1, -1.2 (clipped high), -0.5]  sum -2.8
#                row 1 l = -min(-r, -clip(r)) = [0.8 (clipped low), 1.5]          sum 2.3
@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token_mean", (-2.8 + 2.3) / 5),                       # -0.1
        ("seq_mean_token_mean", (-2.8 / 3 + 2.3 / 2) / 2),      # 0.108333
        ("seq_mean_token_sum_norm", (-2.8 / 3 + 2.3 / 3) / 2),  # -0.083333
    ],
)
def test_grpo_clipped_by_hand(agg, expected):
    out = grpo_loss(*clipped_batch(), agg=agg)
    close(out.loss.item(), expected)
    m = out.metrics
    assert set(m) == METRIC_KEYS
    close(m["clip_frac_high"], 1 / 5)
    close(m["clip_frac_low"], 1 / 5)
    close(m["clip_frac"], 2 / 5)
    close(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 0.5 + 1.5) / 5)  # 1.02; the padded token is not counted
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)
    close(m["approx_kl"], (LN(1.1) ** 2 + 2 * LN(1.5) ** 2 + 2 * LN(0.5) ** 2) / 2 / 5)  # 0.1298794


def test_nan_in_padding_leaks_into_neither_loss_nor_gradient():
    logp, old, adv, mask = clipped_batch()
    logp.requires_grad_(True)
    grpo_loss(logp, old, adv, mask).loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[1, 2] == 0.0


def test_clip_higher_is_asymmetric():
    # DAPO: a ratio of 1.25 with A > 0 is clipped by clip_high 0.2 but not by 0.28
    logp, old = torch.tensor([[LN(1.25)]]), torch.zeros(1, 1)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    tight = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loose = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(tight.loss.item(), -1.2)
    close(loose.loss.item(), -1.25)
    assert tight.metrics["clip_frac_high"] == 1.0 and loose.metrics["clip_frac_high"] == 0.0
    # the low side is governed by clip_low only: 0.75 with A < 0 is clipped at 0.8 -> l = 0.8
    low = grpo_loss(torch.tensor([[LN(0.75)]]), old, -adv, mask, clip_low=0.2, clip_high=0.28)
    close(low.loss.item(), 0.8)
    assert low.metrics["clip_frac_low"] == 1.0 and low.metrics["clip_frac_high"] == 0.0


def test_per_token_advantage():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(grpo_loss(logp, logp, adv, mask).loss.item(), (-2 + 1) / 2)  # -0.5; the masked 3 is ignored
    same = grpo_loss(logp, logp, torch.tensor([[2.0, 2.0, 2.0]]), mask).loss
    assert same.item() == grpo_loss(logp, logp, torch.tensor([2.0]), mask).loss.item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_descent_moves_logp_with_the_advantage(sign):
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    out = grpo_loss(logp, logp.detach(), torch.tensor([sign]), torch.ones(1, 3))
    out.loss.backward()
    # d/dlogp of -A*r/3 at r = 1 is -A/3: a descent step raises logp where A > 0
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -sign / 3))


def test_clipped_token_gets_no_gradient():
    logp = torch.tensor([[LN(1.5), 0.0]], requires_grad=True)
    grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)).loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5]]))


def test_empty_rows():
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    adv = torch.tensor([1.0, 5.0])
    # seq_mean_token_mean: the empty row has no mean and is left out
    close(grpo_loss(logp, logp, adv, mask, agg="seq_mean_token_mean").loss.item(), -1.0)
    # seq_mean_token_sum_norm: it counts with sum 0 -> (-2/2 + 0) / 2
    close(grpo_loss(logp, logp, adv, mask, agg="seq_mean_token_sum_norm").loss.item(), -0.5)


def test_losses_compute_in_float32():
    logp, old, adv, mask = on_policy_batch()
    out = grpo_loss(logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.loss = torch.tensor(0.0)


# ---------------------------------------------------------------- gspo

def gspo_batch():
    """Row 0: 2 tokens, log ratios .2, -.1 -> s = exp(.05); row 1: 3 tokens of .3 -> s = exp(.3)."""
    old = torch.full((2, 3), -2.0)
    log_ratio = torch.tensor([[0.2, -0.1, 5.0], [0.3, 0.3, 0.3]])  # 5.0 sits on padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return (old + log_ratio).requires_grad_(True), old, torch.tensor([1.0, -2.0]), mask


def test_gspo_sequence_ratio_by_hand():
    s0, s1 = math.exp(0.05), math.exp(0.3)  # 1.0512711, 1.3498588
    logp, old, adv, mask = gspo_batch()
    # default clips (3e-4, 4e-4): row 0 (A > 0) is clipped at 1.0004; row 1 (A < 0, s > 1) is not
    out = gspo_loss(logp, old, adv, mask)
    close(out.loss.item(), (-1.0004 + 2 * s1) / 2)  # 0.8496588
    m = out.metrics
    assert set(m) == METRIC_KEYS
    close(m["clip_frac_high"], 0.5)
    close(m["clip_frac_low"], 0.0)
    close(m["ratio_mean"], (s0 + s1) / 2)
    close(m["ratio_max"], s1)
    close(m["ratio_min"], s0)
    close(m["approx_kl"], (0.2**2 + 0.1**2 + 3 * 0.3**2) / 2 / 5)  # 0.032, per token


def test_gspo_gradient_reaches_every_token_of_the_sequence():
    s0, s1 = math.exp(0.05), math.exp(0.3)
    logp, old, adv, mask = gspo_batch()
    out = gspo_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.1)  # nothing clipped
    close(out.loss.item(), (-s0 + 2 * s1) / 2)  # 0.8242233
    out.loss.backward()
    # d l_b / d logp_t = -A_b * s_b / |y_b|, then / 2 sequences
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [2 * s1 / 3 / 2] * 3])
    torch.testing.assert_close(logp.grad, expected)


def test_gspo_on_policy():
    out = gspo_loss(*on_policy_batch())
    close(out.loss.item(), -(1.0 - 2.0) / 2)  # mean over sequences of -A
    assert out.metrics["ratio_min"] == out.metrics["ratio_max"] == 1.0


# ---------------------------------------------------------------- drpo

def drpo_batch(adv=1.0):
    """One sequence: mu = 0.5, 0.25 and ratios 2, 0.5."""
    old = torch.tensor([[LN(0.5), LN(0.25)]])
    return old + torch.tensor([[LN(2.0), LN(0.5)]]), old, torch.tensor([adv]), torch.ones(1, 2)


@pytest.mark.parametrize(
    ("adv", "mu_weighted", "epsilon", "expected"),
    [
        # l = -A*r + |A|*w*(r-1)^2/(2*eps); token 0: r=2, w=.5; token 1: r=.5, w=.25
        (1.0, True, 0.5, ((-2 + 0.5 * 1) + (-0.5 + 0.25 * 0.25)) / 2),           # -0.96875
        (1.0, False, 0.5, ((-2 + 1) + (-0.5 + 0.25)) / 2),                        # -0.625
        (-2.0, True, 0.5, ((4 + 2 * 0.5 * 1) + (1 + 2 * 0.25 * 0.25)) / 2),      # 3.0625
        (1.0, True, 12.5, ((-2 + 0.5 / 25) + (-0.5 + 0.25 * 0.25 / 25)) / 2),    # -1.23875
    ],
)
def test_drpo_by_hand(adv, mu_weighted, epsilon, expected):
    out = drpo_loss(*drpo_batch(adv), epsilon=epsilon, mu_weighted=mu_weighted)
    close(out.loss.item(), expected)
    assert set(out.metrics) == METRIC_KEYS
    close(out.metrics["ratio_mean"], 1.25)


def test_drpo_shares_the_aggregation():
    logp, old, _, _ = drpo_batch()
    # add a one-token row at ratio 1 with mu = .5: l = -1 + 0
    logp = torch.cat([logp, torch.tensor([[LN(0.5), 0.0]])])
    old = torch.cat([old, torch.tensor([[LN(0.5), 0.0]])])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 1.0])
    row0 = (-1.5, -0.4375)
    expected = {
        "token_mean": (sum(row0) - 1) / 3,
        "seq_mean_token_mean": (sum(row0) / 2 - 1) / 2,
        "seq_mean_token_sum_norm": (sum(row0) / 2 - 1 / 2) / 2,  # horizon = L = 2
    }
    for agg, value in expected.items():
        close(drpo_loss(logp, old, adv, mask, epsilon=0.5, agg=agg).loss.item(), value)


def test_drpo_clamps_the_log_ratio_at_20():
    logp = torch.tensor([[25.0, 0.0]], requires_grad=True)
    out = drpo_loss(logp, torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2))
    assert out.metrics["clip_frac_high"] == 0.5 and out.metrics["clip_frac_low"] == 0.0
    close(out.metrics["ratio_max"], math.exp(20), tol=1e3)
    out.loss.backward()
    assert logp.grad[0, 0] == 0.0


def test_drpo_on_policy_and_gradient_sign():
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    out = drpo_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    close(out.loss.item(), -2.0)  # the penalty vanishes at r = 1
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A*r/2


# ---------------------------------------------------------------- errors

def test_bad_inputs_are_named():
    logp, old, adv, mask = on_policy_batch()
    allowed = r"\('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm'\), got 'sum'"
    with pytest.raises(ValueError, match="agg must be one of " + allowed):
        grpo_loss(logp, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match=r"grpo_loss: old_logp has shape \(2, 2\), logp has \(2, 3\)"):
        grpo_loss(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match=r"drpo_loss: adv must have shape \(2,\) or \(2, 3\)"):
        drpo_loss(logp, old, adv[:1], mask)
    with pytest.raises(ValueError, match=r"gspo_loss: adv must have shape \(2,\), got \(2, 3\)"):
        gspo_loss(logp, old, torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="mask selects no token"):
        grpo_loss(logp, old, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="horizon must be a positive"):
        grpo_loss(logp, old, adv, mask, agg="seq_mean_token_sum_norm", horizon=0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        drpo_loss(logp, old, adv, mask, epsilon=0.0)
    with pytest.raises(ValueError, match="logp must be \\(B, L\\)"):
        grpo_loss(logp[0], old[0], adv, mask[0])


def test_every_loss_returns_a_loss_output():
    batch = on_policy_batch()
    for fn in (grpo_loss, gspo_loss, drpo_loss):
        out = fn(*batch)
        assert isinstance(out, LossOutput)
        assert all(isinstance(v, float) for v in out.metrics.values())

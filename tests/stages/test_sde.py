"""unirl.stages.diffusion.sde against hand-computed values from docs/architecture.md, "The math contract"."""
from __future__ import annotations

import math

import pytest
import torch

from unirl.stages.diffusion.sde import (
    SigmaMismatchError,
    check_sigmas,
    dynamic_shift,
    initial_noise,
    sde_step,
    select_sde_steps,
    shifted_sigmas,
    time_shift_sigmas,
)

X = torch.tensor([[1.0, 2.0]])
V = torch.tensor([[0.5, -1.0]])


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------- schedules


def test_shifted_sigmas_by_hand():
    # t = 1, .75, .5, .25, 0; shift 3: 3t/(1+2t) = 1, 2.25/2.5, 1.5/2, .75/1.5, 0.
    s1 = shifted_sigmas(4, 1.0)
    s3 = shifted_sigmas(4, 3.0)
    assert s1.dtype == torch.float32 and s1.shape == (5,)
    close(s1, [1.0, 0.75, 0.5, 0.25, 0.0], atol=0)
    close(s3, [1.0, 0.9, 0.75, 0.5, 0.0], atol=0)


def test_dynamic_shift_and_time_shift():
    assert dynamic_shift(256) == pytest.approx(0.5)
    assert dynamic_shift(4096) == pytest.approx(1.15)
    assert dynamic_shift(2176) == pytest.approx(0.825)  # halfway in tokens, halfway in mu
    # exp(mu)/(exp(mu) + 1/t - 1) with exp(mu) = 3 is the shift-3 schedule.
    close(time_shift_sigmas(4, math.log(3.0)), [1.0, 0.9, 0.75, 0.5, 0.0])
    with pytest.raises(ValueError, match="differ"):
        dynamic_shift(100, base_seq_len=256, max_seq_len=256)


# ---------------------------------------------------------------- sde_step, each kind by hand


def test_flow_step_by_hand():
    # sigma=.8, sigma_next=.6, eta=.5: std = .5*sqrt(.8/.2) = 1, dt = -.2,
    # mean = x*(1 + 1/1.6*(-.2)) + v*(1 + 1*.2/1.6)*(-.2) = .875x - .225v, scale = sqrt(.2).
    out = sde_step("flow", X, V, 0.8, 0.6, eta=0.5, sigma_max=0.9, prev_sample=torch.tensor([[0.7625, 1.975]]))
    close(out.mean, [[0.7625, 1.975]])
    close(out.std, [0.4472136])
    # prev_sample == mean: log N = -log(scale) - log(sqrt(2 pi)) = 0.8047190 - 0.9189385.
    close(out.log_prob, [-0.1142196])


def test_flow_step_log_density_has_its_constant():
    # sigma = .5 makes std = eta: std = .5, dt = -.25, mean = .9375x - .28125v, scale = .25.
    mean = torch.tensor([[0.796875, 2.15625]])
    prev = mean + 0.25 * torch.tensor([[1.0, 0.0]])  # z = (1, 0)
    out = sde_step("flow", X, V, 0.5, 0.25, eta=0.5, sigma_max=0.9, prev_sample=prev)
    close(out.mean, mean.tolist())
    close(out.std, [0.25])
    # mean(-z^2/2) - log(.25) - .5*log(2 pi) = -.25 + 1.3862944 - .9189385
    close(out.log_prob, [0.2173558])
    normal = torch.distributions.Normal(mean, 0.25)
    close(out.log_prob, normal.log_prob(prev).mean(-1).tolist())


def test_flow_log_prob_matches_torch_normal_on_images():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    out = sde_step("flow", x, v, 0.7, 0.55, eta=0.8, sigma_max=0.95, generator=g)
    assert out.log_prob.shape == (2,) and out.std.shape == (2,)
    expected = torch.distributions.Normal(out.mean, out.std.view(2, 1, 1, 1)).log_prob(out.prev_sample)
    torch.testing.assert_close(out.log_prob, expected.mean(dim=(1, 2, 3)), atol=1e-5, rtol=1e-6)


def test_sigma_one_uses_sigma_max():
    # sigma=1, sigma_max=.8, eta=.5: std = .5*sqrt(1/.2) = 1.1180340, std^2 = 1.25, dt = -.2,
    # mean = x*(1 + 1.25/2*(-.2)) + v*(1 + 0)*(-.2) = .875x - .2v, scale = 1.118034*sqrt(.2) = .5.
    out = sde_step("flow", X, V, 1.0, 0.8, eta=0.5, sigma_max=0.8, prev_sample=X)
    close(out.mean, [[0.775, 1.95]])
    close(out.std, [0.5])
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step("flow", X, V, 1.0, 0.8, eta=0.5, sigma_max=1.0)


def test_dance_step_by_hand():
    # std = eta = .3 at sigma=.8: mean = x*(1 + .09/1.6*(-.2)) + v*(1 + .09*.2/1.6)*(-.2)
    #                                  = .98875x - .20225v, scale = .3*sqrt(.2).
    out = sde_step("dance", X, V, 0.8, 0.6, eta=0.3, sigma_max=0.9, prev_sample=X)
    close(out.mean, [[0.8876250, 2.1797500]])
    close(out.std, [0.1341641])


def test_dance_equals_flow_when_flow_std_equals_eta():
    # At sigma = .5, sqrt(sigma/(1-sigma)) = 1, so flow's std is exactly eta.
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    flow = sde_step("flow", x, v, 0.5, 0.3, eta=0.7, sigma_max=0.9, generator=torch.Generator().manual_seed(5))
    dance = sde_step("dance", x, v, 0.5, 0.3, eta=0.7, sigma_max=0.9, generator=torch.Generator().manual_seed(5))
    for a, b in zip((flow.prev_sample, flow.log_prob, flow.mean, flow.std),
                    (dance.prev_sample, dance.log_prob, dance.mean, dance.std)):
        assert torch.equal(a, b)


def test_cps_step_by_hand():
    # sigma=.8, sigma_next=.5, sin(eta*pi/2) = .6: std = .3, sqrt(.25 - .09) = .4;
    # x0 = x - .8v = (.6, 2.8), x1 = x + .2v = (1.1, 1.8), mean = .5*x0 + .4*x1 = (.74, 2.12).
    eta = 2 * math.asin(0.6) / math.pi
    prev = torch.tensor([[0.74 + 0.3, 2.12 - 0.1]])
    out = sde_step("cps", X, V, 0.8, 0.5, eta=eta, sigma_max=0.9, prev_sample=prev)
    close(out.mean, [[0.74, 2.12]])
    close(out.std, [0.3])
    close(out.log_prob, [-0.05])  # -mean(.3^2, .1^2)


def test_ode_and_eta_zero_are_the_euler_step():
    dt = torch.tensor(0.6) - torch.tensor(0.8)
    euler = X + V * dt
    close(euler, [[0.9, 2.2]])
    for kind in ("flow", "dance", "cps", "ode"):
        out = sde_step(kind, X, V, 0.8, 0.6, eta=0.0 if kind != "ode" else 0.7, sigma_max=0.9)
        assert torch.equal(out.prev_sample, euler), kind
        assert out.log_prob is None
        assert torch.equal(out.std, torch.zeros(1))


def test_sampling_draws_mean_plus_scale_times_noise():
    out = sde_step("flow", X, V, 0.8, 0.6, eta=0.5, sigma_max=0.9, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(X.shape, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out.prev_sample, out.mean + out.std.view(1, 1) * noise)


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_replay_reproduces_sampling_log_prob_bitwise(kind):
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    sigmas = shifted_sigmas(10, 3.0)
    sampled = sde_step(kind, x, v, float(sigmas[0]), float(sigmas[1]), eta=0.7,
                       sigma_max=float(sigmas[1]), generator=g)
    # Replay as training does: per-sample sigma tensors and the stored prev_sample.
    replayed = sde_step(kind, x.clone(), v.clone(), sigmas[0].expand(4), sigmas[1].expand(4), eta=0.7,
                        sigma_max=float(sigmas[1]), prev_sample=sampled.prev_sample)
    assert torch.equal(sampled.log_prob, replayed.log_prob)
    assert torch.equal(sampled.mean, replayed.mean)
    assert torch.equal(replayed.prev_sample, sampled.prev_sample)


def test_per_sample_sigmas_match_scalar_calls():
    x, v = torch.cat([X, 2 * X]), torch.cat([V, -V])
    prev = x + 0.1
    batched = sde_step("flow", x, v, torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.25]), eta=0.5,
                       sigma_max=0.9, prev_sample=prev)
    for i, (s, sn) in enumerate([(0.8, 0.6), (0.5, 0.25)]):
        one = sde_step("flow", x[i:i + 1], v[i:i + 1], s, sn, eta=0.5, sigma_max=0.9, prev_sample=prev[i:i + 1])
        assert torch.equal(batched.log_prob[i:i + 1], one.log_prob)
        assert torch.equal(batched.mean[i:i + 1], one.mean)


def test_inputs_cast_to_float32_and_grad_flows_through_v():
    v = V.to(torch.bfloat16).float().requires_grad_()
    out = sde_step("flow", X.to(torch.bfloat16), v, 0.8, 0.6, eta=0.5, sigma_max=0.9, prev_sample=X.double())
    assert out.prev_sample.dtype == out.mean.dtype == out.log_prob.dtype == torch.float32
    out.log_prob.sum().backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)


def test_unknown_kind_lists_allowed_kinds():
    with pytest.raises(ValueError, match=r"rollout.sampler.sde_kind: unknown SDE kernel 'ddim' \(allowed: cps, dance, flow, ode\)"):
        sde_step("ddim", X, V, 0.8, 0.6, eta=0.5, sigma_max=0.9)
    with pytest.raises(ValueError, match="batch of 1"):
        sde_step("flow", X, V, torch.tensor([0.8, 0.7]), 0.6, eta=0.5, sigma_max=0.9)


# ---------------------------------------------------------------- step selection


def test_select_all():
    assert select_sde_steps(5, mode="all").tolist() == [0, 1, 2, 3, 4]


def test_select_window_whole_range_needs_no_generator():
    # T=10, steps i with .2 <= i/10 < .6 (0.6*10 is 6.000000000000001 in floats).
    steps = select_sde_steps(10, mode="window", window=(0.2, 0.6))
    assert steps.dtype == torch.long and steps.tolist() == [2, 3, 4, 5]


def test_select_window_seeded_draw_is_reproducible():
    def draw(seed):
        return select_sde_steps(10, mode="window", window=(0.0, 0.5), window_size=3, num_sde_steps=2,
                                generator=torch.Generator().manual_seed(seed)).tolist()

    first = draw(7)
    assert first == draw(7)
    assert len(first) == 2 and first == sorted(first) and first[1] - first[0] <= 2
    assert all(0 <= i < 5 for i in first)
    assert len({tuple(draw(s)) for s in range(20)}) > 1
    with pytest.raises(ValueError, match="generator"):
        select_sde_steps(10, mode="window", window=(0.0, 0.5), window_size=3)


def test_select_window_too_large_says_what_to_do():
    with pytest.raises(ValueError, match=r"window_size 6 is larger than the 5 steps.*lower window_size"):
        select_sde_steps(10, mode="window", window=(0.0, 0.5), window_size=6)
    with pytest.raises(ValueError, match="larger than the 4 steps"):
        select_sde_steps(4, mode="mixgrpo", window_size=5)
    with pytest.raises(ValueError, match="num_sde_steps"):
        select_sde_steps(10, mode="window", window_size=3, num_sde_steps=4, generator=torch.Generator())


def test_select_mixgrpo_slides_then_clamps_or_wraps():
    # T=10, window 3, stride 2, moving every 5 iterations; the last position starts at 7.
    def at(it, wrap=False):
        return select_sde_steps(10, mode="mixgrpo", window_size=3, stride=2, shift_every=5,
                                iteration=it, wrap=wrap).tolist()

    assert at(0) == at(4) == [0, 1, 2]
    assert at(5) == [2, 3, 4]
    assert at(10) == [4, 5, 6]
    assert at(15) == [6, 7, 8]
    assert at(20) == at(100) == [7, 8, 9]
    # wrap: positions 0, 2, 4, 6, then back to 0.
    assert at(20, wrap=True) == [0, 1, 2]
    assert at(25, wrap=True) == [2, 3, 4]
    # inside a fraction range [.5, 1]: starts at step 5.
    assert select_sde_steps(10, mode="mixgrpo", window=(0.5, 1.0), window_size=2).tolist() == [5, 6]


def test_select_unknown_mode():
    with pytest.raises(ValueError, match="all, window, mixgrpo"):
        select_sde_steps(10, mode="random")


# ---------------------------------------------------------------- initial noise and sigma boundary


def test_initial_noise_same_group_same_noise():
    a, seed_a = initial_noise((2, 4, 4), base_seed=42, group_id=3, sample_id="s0")
    b, seed_b = initial_noise((2, 4, 4), base_seed=42, group_id=3, sample_id="s1")
    c, seed_c = initial_noise((2, 4, 4), base_seed=42, group_id=4)
    d, _ = initial_noise((2, 4, 4), base_seed=43, group_id=3)
    assert seed_a == seed_b and torch.equal(a, b) and a.dtype == torch.float32
    assert seed_c != seed_a and not torch.equal(a, c) and not torch.equal(a, d)
    assert torch.equal(a, torch.randn((2, 4, 4), generator=torch.Generator().manual_seed(seed_a)))


def test_initial_noise_per_sample():
    a, _ = initial_noise((4,), base_seed=42, group_id=3, sample_id="s0", init_same_noise=False)
    b, _ = initial_noise((4,), base_seed=42, group_id=3, sample_id="s1", init_same_noise=False)
    a2, _ = initial_noise((4,), base_seed=42, group_id=9, sample_id="s0", init_same_noise=False)
    assert not torch.equal(a, b) and torch.equal(a, a2)
    with pytest.raises(ValueError, match="sample_id"):
        initial_noise((4,), base_seed=42, group_id=3, init_same_noise=False)


def test_check_sigmas_names_the_first_differing_index():
    check_sigmas([1.0, 0.9, 0.75, 0.5, 0.0], shifted_sigmas(4, 3.0))
    with pytest.raises(SigmaMismatchError, match=r"index 2: requested 0.75, engine used 0.7\b"):
        check_sigmas([1.0, 0.9, 0.75, 0.5, 0.0], [1.0, 0.9, 0.7, 0.4, 0.0])
    with pytest.raises(SigmaMismatchError, match="requested 5 sigmas but the engine used 4"):
        check_sigmas(shifted_sigmas(4, 3.0), shifted_sigmas(3, 3.0))

"""One micro-batch of a diffusion update on hand-made velocity models: gradient accumulation
across timesteps and micro-batches equals the loss over the whole batch, the on-policy check,
Flow-DPPO's frozen old means, NFT against its closed form, and LoRA merging."""
from __future__ import annotations

import pytest
import torch

from stages.algorithms import flow_grpo_loss, nft_loss
from stages.diffusion import losses as L
from stages.diffusion.export import merge_lora
from stages.diffusion.sampling import make_plan, replay_step, sample, sample_noise, stored_steps
from stages.diffusion.trajectory import LatentBatch
from stages.recipe_diffusion import DiffusionSampler, FlowDPPOConfig, FlowGRPOConfig, NFTConfig

SHAPE = (2, 4, 4)


class Linear(torch.nn.Module):
    """v(x, sigma) = W x + sigma * b, per pixel (a 1x1 conv): enough to carry gradients."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(2, 2, generator=g) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(2, generator=g) * 0.1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return torch.einsum("oc,bchw->bohw", self.w, x) + sigma.reshape(-1, 1, 1, 1) * self.b.reshape(1, 2, 1, 1)


def rollouts(model, n=4, steps=4, kind="flow", mode="all"):
    s = DiffusionSampler(num_steps=steps, sde_kind=kind, sde_steps={"mode": mode, "window_size": 2, "num_sde_steps": 2}
                         if mode == "window" else {"mode": mode})
    plan = make_plan(s, seed=0, iteration=0, latent_tokens=4)
    store = stored_steps(plan.sde_indices.tolist(), steps)
    traj = sample(model, sample_noise(SHAPE, list(range(n))), plan, list(range(100, 100 + n)), store=store)
    return LatentBatch([f"g/{i}" for i in range(n)], ["p"] * n, traj.latents, traj.logprobs, traj.stored, plan)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_flow_grpo_accumulated_over_steps_and_micro_batches_equals_whole_batch_loss():
    model = Linear()
    batch = rollouts(model, mode="window")
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    algo = FlowGRPOConfig(clip_range=0.2)
    # reference: every step's log-prob in one (B, K) tensor, one backward
    logps = []
    for step in batch.plan.sde_indices.tolist():
        x = batch.at(step)
        logps.append(replay_step(batch.plan, step, x, model(x, batch.plan.sigmas[step].expand(4)), batch.at(step + 1)).log_prob)
    flow_grpo_loss(torch.stack(logps, 1), batch.logprobs, adv, clip_range=0.2).loss.backward()
    expected = grads(model)
    model.zero_grad()
    halves = [LatentBatch(batch.sample_ids[i:i + 2], batch.prompts[i:i + 2], batch.latents[i:i + 2], batch.logprobs[i:i + 2],
                          batch.stored, batch.plan) for i in (0, 2)]
    for i, half in enumerate(halves):
        m = L.likelihood_backward(algo, half, adv[2 * i:2 * i + 2], model, weight=0.5, check_on_policy=True)
        assert m["ratio_min"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    for got, want in zip(grads(model), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_first_update_off_policy_raises():
    model = Linear()
    batch = rollouts(model)
    batch.logprobs[1, 2] += 1e-6
    with pytest.raises(L.OnPolicyRatioError, match="SDE step 2 differ from the sampled ones"):
        L.likelihood_backward(FlowGRPOConfig(), batch, torch.ones(4), model, weight=1.0, check_on_policy=True)


def test_kl_to_the_reference_adds_its_gradient():
    model, ref = Linear(0), Linear(1)
    batch = rollouts(model, steps=3)
    adv = torch.zeros(4)  # only the KL term moves the weights
    m = L.likelihood_backward(FlowGRPOConfig(kl_coef=2.0), batch, adv, model, weight=1.0, ref_velocity=ref)
    assert m["kl"] > 0
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_flow_dppo_drops_with_frozen_old_means():
    model = Linear()
    batch = rollouts(model, steps=3)
    old_means = L.transition_means(model, batch)
    with torch.no_grad():  # the policy moves after the means were frozen
        model.w.add_(0.5)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    m = L.likelihood_backward(FlowDPPOConfig(threshold=1e-12), batch, adv, model, weight=1.0, old_means=old_means)
    assert 0 < m["drop_frac"] <= 1
    model.zero_grad()
    on_policy = L.likelihood_backward(FlowDPPOConfig(threshold=1e-12), batch, adv, model, weight=1.0)
    assert on_policy["drop_frac"] == 0.0  # old mean = current mean: k = 0 < threshold


def test_nft_backward_is_the_mean_of_nft_loss_over_draws():
    model, old = Linear(0), Linear(1)
    batch = rollouts(model, mode="all")
    algo = NFTConfig(timesteps=3, beta=0.7)
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0])
    points = L.nft_points(batch, seed=5, iteration=2, update=0, draws=3)
    with torch.no_grad():
        v_old = [old(xt, t) for t, xt in points]
    L.nft_backward(algo, batch, adv, model, v_old, weight=1.0, seed=5, iteration=2, update=0)
    got = grads(model)
    model.zero_grad()
    total = sum(nft_loss(batch.final, xt, t, model(xt, t), vo, adv, beta=0.7).loss for (t, xt), vo in zip(points, v_old)) / 3
    total.backward()
    for g, want in zip(got, grads(model)):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)
    t0, _ = points[0]
    assert set(t0.tolist()) <= set(batch.plan.sigmas[batch.plan.sigmas > 0].tolist())
    again = L.nft_points(batch, seed=5, iteration=2, update=0, draws=3)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(points, again))


def test_merge_lora_folds_the_update_into_the_base_weight():
    from peft import LoraConfig, get_peft_model

    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    peft = get_peft_model(net, LoraConfig(r=2, lora_alpha=6, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(4, 3)
    with torch.no_grad():
        want = peft(x)
    state = {k.removeprefix("base_model.model."): v for k, v in peft.state_dict().items()}
    merged = merge_lora(state, rank=2, alpha=6)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), want, atol=1e-5, rtol=1e-5)

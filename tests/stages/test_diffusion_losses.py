"""One micro-batch of a flow algorithm's update on hand-made velocity models: gradient
accumulation across timesteps and micro-batches equals the loss over the whole batch, the
behaviour check, Flow-DPPO's frozen old means, NFT against its closed form, and LoRA merging.

The algorithms replay through a policy (`replay`, `velocity`); here a two-method stand-in binds
them to a hand-made linear velocity, so the losses are checked against hand-computed tensors
without a diffusion model."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from unirl.stages.algorithms import BehaviourMismatchError, TrainContext
from unirl.stages.algorithms.flow_dppo import FlowDPPO, FlowDPPOConfig
from unirl.stages.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.stages.algorithms.nft import NFT, NFTConfig
from unirl.stages.diffusion.sampling import make_plan, replay_step, sample, stored_steps
from unirl.stages.diffusion.trajectory import LatentBatch
from unirl.stages.kernels.flow_losses import flow_grpo_loss, nft_loss, nft_points
from unirl.stages.models.flow_lora import merge_lora
from unirl.stages.policies.flow import FlowSampler

SHAPE = (2, 4, 4)


def noise(n: int) -> torch.Tensor:
    return torch.stack([torch.randn(SHAPE, generator=torch.Generator().manual_seed(s)) for s in range(n)])


class LinearPolicy:
    """The flow policy's replay and velocity, bound to a hand-made velocity model `module`."""

    def velocity(self, module, prompts):
        return module

    def replay(self, module, batch, step):
        x = batch.at(step)
        return replay_step(batch.plan, step, x, module(x, batch.plan.sigmas[step].expand(x.shape[0])), batch.at(step + 1))


@dataclass
class Stack:
    module: Any
    ref: Any = None
    world: int = 1

    @contextmanager
    def reference(self):
        yield self.ref


def ctx(model, ref=None, tolerance=0.0) -> TrainContext:
    return TrainContext(LinearPolicy(), Stack(model, ref), iteration=2, seed=5, tolerance=tolerance)


class Linear(torch.nn.Module):
    """v(x, sigma) = W x + sigma * b, per pixel (a 1x1 conv): enough to carry gradients."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(2, 2, generator=g) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(2, generator=g) * 0.1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return torch.einsum("oc,bchw->bohw", self.w, x) + sigma.reshape(-1, 1, 1, 1) * self.b.reshape(1, 2, 1, 1)


def rollouts(model, n=4, steps=4, kind="flow", mode="all", adv=None):
    s = FlowSampler(num_steps=steps, sde_kind=kind, sde_steps={"mode": mode, "window_size": 2, "num_sde_steps": 2}
                    if mode == "window" else {"mode": mode})
    plan = make_plan(s, seed=0, iteration=0, latent_tokens=4)
    store = stored_steps(plan.sde_indices.tolist(), steps)
    traj = sample(model, noise(n), plan, list(range(100, 100 + n)), store=store)
    return LatentBatch([f"g/{i}" for i in range(n)], ["p"] * n, traj.latents, traj.logprobs, traj.stored, plan,
                       torch.zeros(n) if adv is None else adv)


def part(batch, lo, hi):
    return LatentBatch(batch.sample_ids[lo:hi], batch.prompts[lo:hi], batch.latents[lo:hi], batch.logprobs[lo:hi],
                       batch.stored, batch.plan, batch.advantage[lo:hi])


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_flow_grpo_accumulated_over_steps_and_micro_batches_equals_whole_batch_loss():
    model = Linear()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    batch = rollouts(model, mode="window", adv=adv)
    algo = FlowGRPO(FlowGRPOConfig(clip_range=0.2), None)
    # reference: every step's log-prob in one (B, K) tensor, one backward
    logps = []
    for step in batch.plan.sde_indices.tolist():
        x = batch.at(step)
        logps.append(replay_step(batch.plan, step, x, model(x, batch.plan.sigmas[step].expand(4)), batch.at(step + 1)).log_prob)
    flow_grpo_loss(torch.stack(logps, 1), batch.logprobs, adv, clip_range=0.2).loss.backward()
    expected = grads(model)
    model.zero_grad()
    for half in (part(batch, 0, 2), part(batch, 2, 4)):
        m = algo.loss_backward(ctx(model), half, None, share=0.5, update=0, real=True)
        assert m["ratio_min"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
        assert m["behaviour_logp_max_abs_diff"] == 0.0
    for got, want in zip(grads(model), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_first_update_off_policy_raises_naming_the_sample_and_step():
    model = Linear()
    batch = rollouts(model, adv=torch.ones(4))
    batch.logprobs[1, 2] += 1e-6
    with pytest.raises(BehaviourMismatchError, match=r"iteration 2, rank 0: sample 'g/1': the trainer's replay of SDE step 2"):
        FlowGRPO(FlowGRPOConfig(), None).loss_backward(ctx(model), batch, None, share=1.0, update=0, real=True)
    # later updates replay a moved policy: no behaviour check there
    FlowGRPO(FlowGRPOConfig(), None).loss_backward(ctx(model), batch, None, share=1.0, update=1, real=True)


def test_kl_to_the_reference_adds_its_gradient():
    model, ref = Linear(0), Linear(1)
    batch = rollouts(model, steps=3)  # advantages 0: only the KL term moves the weights
    m = FlowGRPO(FlowGRPOConfig(kl_coef=2.0), None).loss_backward(ctx(model, ref), batch, None, share=1.0, update=0, real=True)
    assert m["kl"] > 0
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_flow_dppo_drops_with_frozen_old_means():
    model = Linear()
    batch = rollouts(model, steps=3, adv=torch.tensor([1.0, -1.0, 1.0, -1.0]))
    algo = FlowDPPO(FlowDPPOConfig(threshold=1e-12), None)
    assert algo.freeze_old(ctx(model), batch, update=0) is None  # the first mini-batch uses the live means
    old = algo.freeze_old(ctx(model), batch, update=1)
    with torch.no_grad():  # each SDE step's transition under the weights before any step
        outs = [LinearPolicy().replay(model, batch, j) for j in batch.plan.sde_indices.tolist()]
    torch.testing.assert_close(old["mean"], torch.stack([o.mean for o in outs], dim=1))
    torch.testing.assert_close(old["logp"], torch.stack([o.log_prob for o in outs], dim=1))
    old_means = old
    with torch.no_grad():  # the policy moves after the means were frozen
        model.w.add_(0.5)
    m = algo.loss_backward(ctx(model), batch, old_means, share=1.0, update=1, real=True)
    assert 0 < m["drop_frac"] <= 1
    model.zero_grad()
    on_policy = algo.loss_backward(ctx(model), batch, None, share=1.0, update=1, real=True)
    assert on_policy["drop_frac"] == 0.0  # old mean = current mean: k = 0 < threshold


def test_nft_backward_is_the_mean_of_nft_loss_over_draws():
    model, old = Linear(0), Linear(1)
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0])
    batch = rollouts(model, mode="all", adv=adv)
    algo = NFT(NFTConfig(timesteps=3, beta=0.7), None)
    points = nft_points(batch, seed=5, iteration=2, update=0, draws=3)
    with torch.no_grad():
        v_old = algo.freeze_old(ctx(old), batch, update=0)  # under the old (EMA) weights
    algo.loss_backward(ctx(model), batch, v_old, share=1.0, update=0, real=True)
    got = grads(model)
    model.zero_grad()
    total = sum(nft_loss(batch.final, xt, t, model(xt, t), vo, adv, beta=0.7).loss for (t, xt), vo in zip(points, v_old)) / 3
    total.backward()
    for g, want in zip(got, grads(model)):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)
    t0, _ = points[0]
    assert set(t0.tolist()) <= set(batch.plan.sigmas[batch.plan.sigmas > 0].tolist())
    again = nft_points(batch, seed=5, iteration=2, update=0, draws=3)
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

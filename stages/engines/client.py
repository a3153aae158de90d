"""A client of SGLang's native HTTP API, the subset unirl uses; unirl's own engine server
(stages/engine_server/) speaks the same subset, so one client drives both.

Every request body below names only fields of SGLang's own request definitions
(`sglang/srt/managers/io_struct.py`; for diffusion `RolloutRequest` in
`sglang/multimodal_gen/runtime/entrypoints/post_training/io_struct.py`), and every response
field it reads is one SGLang's server returns: tests/stages/engines/test_sglang_contract.py checks
both against the released package source. `RESPONSE_READS` lists what is read, per route.

Auth: `Authorization: Bearer <token>` (SGLang's `--api-key`, the engine server's token); a
token never appears in a log line or an error message.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Response fields this client reads, per route ("a.b": key b of the object under key a).
RESPONSE_READS: dict[str, tuple[str, ...]] = {
    "/generate": ("output_ids", "meta_info.id", "meta_info.finish_reason", "meta_info.weight_version",
                  "meta_info.output_token_logprobs", "meta_info.input_token_logprobs", "meta_info.prompt_tokens",
                  "meta_info.completion_tokens"),
    "/model_info": ("model_path", "weight_version"),
    "/update_weights_from_disk": ("success", "message"),
    "/update_weights_from_distributed": ("success", "message"),
    "/init_weights_update_group": ("success", "message"),
    "/destroy_weights_update_group": ("success", "message"),
    "/update_weight_version": ("success", "message"),
    "/load_lora_adapter": ("success", "error_message"),
    "/unload_lora_adapter": ("success", "error_message"),
    "/pause_generation": ("status",),
    "/continue_generation": ("status",),
    "/rollout/generate": ("request_id", "seed", "generated_output", "rollout_log_probs", "dit_trajectory"),
}
# The `type` values of SGLang's finish reasons (schedule_batch.py FINISH_*.to_json()) and ours.
FINISH_TYPES = {"stop": "stop", "length": "length"}


class EngineError(RuntimeError):
    """The engine answered a request with an error (the message names the engine and the route)."""


GENERATE_CHUNK_PROMPTS = 512
GENERATE_CHUNK_BYTES = 4 << 20  # JSON of one /generate; engine_server refuses 16 MiB (--max-request-bytes)
KEEPALIVE_S = 1.0  # seconds an idle connection is kept for reuse


def generate_chunks(lengths: list[int], max_prompts: int = GENERATE_CHUNK_PROMPTS,
                    max_bytes: int = GENERATE_CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) ranges of prompts (token counts `lengths`) for one /generate each: at most
    `max_prompts`, and about `max_bytes` of JSON (8 bytes a token id, 256 for its sampling params)."""
    chunks, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        cost = 8 * n + 256
        if i > start and (i - start >= max_prompts or size + cost > max_bytes):
            chunks.append((start, i))
            start, size = i, 0
        size += cost
    chunks.append((start, len(lengths)))
    return chunks


class EngineUnreachable(EngineError):
    """No engine answers at the configured URL."""


class EngineClient:
    """Blocking HTTP calls to one engine at `url` (http://host:port)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 600.0, name: str = "rollout engine",
                 connections: int = 100):
        import httpx  # start-up time: httpx loads on first use, not when a recipe is read

        self.url = url.rstrip("/")
        self.name = name
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # An idle connection is dropped after KEEPALIVE_S, before the server drops it (uvicorn, which vLLM, SGLang and
        # our engine server run on, closes idle ones after 5 s): a request sent on a connection the server is closing
        # fails as if the server went away (met between an agent's turns, which leave the pool idle).
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                  limits=httpx.Limits(max_connections=connections, keepalive_expiry=KEEPALIVE_S))
        self.sent: list[tuple[str, str, Any]] | None = None  # (method, route, body) when recording (contract tests)
        self.chunk_prompts, self.chunk_bytes = GENERATE_CHUNK_PROMPTS, GENERATE_CHUNK_BYTES  # one /generate at most

    def close(self) -> None:
        self._http.close()

    # -- transport -------------------------------------------------------------------------------
    def _call(self, method: str, route: str, body: Any = None, *, msgpack_reply: bool = False) -> Any:
        import httpx  # start-up time: httpx loads on first use, not when a recipe is read

        if self.sent is not None:
            self.sent.append((method, route, body))
        try:
            reply = self._http.request(method, route, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise EngineUnreachable(
                f"{self.name} at {self.url} is unreachable ({type(exc).__name__}: nothing answers on {route}); start it "
                "(docs/engines.md) or fix rollout.engine.url") from None
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            raise EngineUnreachable(f"{self.name} at {self.url} went away during {route} ({type(exc).__name__})") from None
        except httpx.TimeoutException:
            raise EngineError(f"{self.name} at {self.url}: {route} timed out") from None
        if reply.status_code == 401:
            raise EngineError(f"{self.name} at {self.url}: {route} refused the token (401); set the engine's token in "
                              "the variable rollout.engine.token_env names")
        if msgpack_reply and reply.status_code == 200:
            import msgpack  # start-up time: msgpack loads on first use, not when a recipe is read

            return msgpack.unpackb(reply.content, raw=False)
        try:
            data = reply.json() if reply.content.strip() else {}
        except ValueError:  # SGLang answers /flush_cache in plain text
            data = {"message": reply.text.strip()} if reply.status_code >= 400 else {}
        data = {} if data is None else data
        if reply.status_code >= 400:
            detail = data.get("message") or data.get("error_message") or data.get("error") or data.get("detail") or data
            raise EngineError(f"{self.name} at {self.url}: {route} failed ({reply.status_code}): {detail}")
        return data

    @staticmethod
    def _ok(route: str, data: dict[str, Any], url: str) -> dict[str, Any]:
        if not data.get("success", False):
            raise EngineError(f"rollout engine at {url}: {route} did not succeed: "
                              f"{data.get('message') or data.get('error_message')}")
        return data

    # -- health and identity -----------------------------------------------------------------------
    def wait_ready(self, timeout_s: float, alive: Any = None) -> dict[str, Any]:
        """/model_info once the engine answers (polling up to `timeout_s`; `alive()` False ends it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.model_info()
            except EngineUnreachable:
                if time.monotonic() > deadline or (alive is not None and not alive()):
                    raise
                time.sleep(0.1)

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/model_info")

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    # -- text -------------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                 lora_path: str | None = None, rid: str | None = None) -> list[dict[str, Any]]:
        """Batched /generate (GenerateReqInput with a list of prompts): per prompt {"output_ids",
        "meta_info": {"finish_reason", "weight_version", "output_token_logprobs", ...}}. A large
        batch goes as several requests at once (at most `chunk_prompts` prompts and about
        `chunk_bytes` each, under what an engine accepts in one request); answers in order."""
        chunks = generate_chunks([len(ids) for ids in input_ids], self.chunk_prompts, self.chunk_bytes)

        def one(k: int, start: int, end: int) -> list[dict[str, Any]]:
            body: dict[str, Any] = {"input_ids": input_ids[start:end], "sampling_params": sampling_params[start:end],
                                    "return_logprob": True}
            if lora_path is not None:
                body["lora_path"] = [lora_path] * (end - start)
            if rid is not None:
                body["rid"] = rid if len(chunks) == 1 else f"{rid}-{k}"
            out = self._call("POST", "/generate", body)
            return out if isinstance(out, list) else [out]

        if len(chunks) == 1:
            return one(0, *chunks[0])

        with ThreadPoolExecutor(max_workers=min(8, len(chunks))) as pool:
            parts = list(pool.map(lambda chunk: one(*chunk), [(k, s, e) for k, (s, e) in enumerate(chunks)]))
        return [out for part in parts for out in part]

    def prompt_logprobs(self, tokens: list[int], lora: str | None = None) -> list[float]:
        """log p(tokens[i] | tokens[:i]) for i >= 1 at temperature 1 (the canary check): one
        /generate of a token with `logprob_start_len` 0, whose input_token_logprobs these are."""
        body: dict[str, Any] = {"input_ids": [list(tokens)], "sampling_params": [{"max_new_tokens": 1, "temperature": 1.0}],
                                "return_logprob": True, "logprob_start_len": 0}
        if lora is not None:
            body["lora_path"] = [lora]
        out = self._call("POST", "/generate", body)
        info = (out[0] if isinstance(out, list) else out).get("meta_info") or {}
        pairs = info.get("input_token_logprobs") or []
        if len(pairs) != len(tokens):
            raise EngineError(f"{self.name} at {self.url}: {len(pairs)} input_token_logprobs for {len(tokens)} prompt tokens")
        if [int(p[1]) for p in pairs] != list(tokens):
            raise EngineError(f"{self.name} at {self.url}: input_token_logprobs name other tokens than the prompt's")
        return [float(p[0]) for p in pairs[1:]]

    # -- weights ----------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> dict[str, Any]:
        """Load a weights folder on the engine's host; `weight_version` (text engines: SGLang's
        UpdateWeightFromDiskReqInput has it, the diffusion one does not) is what it reports after."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": True}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._ok("/update_weights_from_disk", self._call("POST", "/update_weights_from_disk", body), self.url)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> dict[str, Any]:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return self._ok("/init_weights_update_group", self._call("POST", "/init_weights_update_group", body), self.url)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str, weight_version: str) -> dict[str, Any]:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "weight_version": weight_version, "flush_cache": True}
        return self._ok("/update_weights_from_distributed",
                        self._call("POST", "/update_weights_from_distributed", body), self.url)

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def update_weight_version(self, new_version: str) -> dict[str, Any]:
        """Set the version the engine reports (after a LoRA adapter load, which leaves it alone);
        requests in flight are not aborted."""
        body = {"new_version": new_version, "abort_all_requests": False}
        return self._ok("/update_weight_version", self._call("POST", "/update_weight_version", body), self.url)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return self._ok("/load_lora_adapter", self._call("POST", "/load_lora_adapter", body), self.url)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self._ok("/unload_lora_adapter", self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}), self.url)

    # -- scheduling and memory -----------------------------------------------------------------------
    def pause_generation(self, mode: str = "in_place") -> dict[str, Any]:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict[str, Any]:
        return self._call("POST", "/continue_generation", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/resume_memory_occupation", {"tags": tags})

    def flush_cache(self) -> Any:
        return self._call("POST", "/flush_cache")

    # -- diffusion ----------------------------------------------------------------------------------
    def rollout_generate(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """SGLang diffusion's POST /rollout/generate: a RolloutRequest -> msgpack list of
        RolloutResponse (tensors as {"__tensor__": True, "data": safetensors bytes, ...})."""
        return self._call("POST", "/rollout/generate", request, msgpack_reply=True)

    def get_weights_checksum(self, module_names: list[str] | None = None) -> dict[str, str]:
        return self._call("POST", "/get_weights_checksum", {"module_names": module_names})


def finish_reason(meta_info: dict[str, Any], where: str) -> str:
    """Our finish reason ("stop" | "length") from SGLang's {"type": ...}; an abort is an error."""
    reason = meta_info.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_TYPES:
        raise EngineError(f"{where}: generation ended with finish_reason {reason!r} (not stop/length): the engine "
                          "aborted it (paused with mode abort, or out of memory)")
    return FINISH_TYPES[kind]


def tensor_from_wire(obj: Any) -> Any:
    """A tensor from SGLang's `_maybe_serialize` form ({"__tensor__": True, "data": safetensors
    bytes of {"t": tensor}, "shape", "dtype"}); dicts and lists are walked, other values returned."""
    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            from safetensors.torch import load  # start-up time: safetensors loads on first use, not when a recipe is read

            return load(bytes(obj["data"]))["t"]
        return {k: tensor_from_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tensor_from_wire(v) for v in obj]
    return obj


def tensor_to_wire(obj: Any) -> Any:
    """The inverse of `tensor_from_wire` (what the engine server sends)."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    if isinstance(obj, torch.Tensor):
        from safetensors.torch import save  # start-up time: safetensors loads on first use, not when a recipe is read

        t = obj.detach().contiguous().cpu()
        return {"__tensor__": True, "data": save({"t": t}), "shape": list(t.shape), "dtype": str(t.dtype)}
    if isinstance(obj, dict):
        return {k: tensor_to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tensor_to_wire(v) for v in obj]
    return obj

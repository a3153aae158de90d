"""The engine server's HTTP API: the subset of SGLang's native API that unirl's client uses
(stages/engines/client.py), with SGLang's request fields and response keys, so the same client,
weight sync and async pipeline run against it and against SGLang.

    GET  /health, /model_info                        no token: liveness, weight_version
    POST /generate                                   text: batched, return_logprob, meta_info.weight_version
    POST /rollout/generate                           flow models: trajectories and per-step log-probs (msgpack)
    POST /update_weights_from_disk                   a published weights folder (sha256 manifest checked)
    POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
    POST /load_lora_adapter, /unload_lora_adapter    hot-load PEFT adapters under a versioned name
    POST /update_weight_version                      the version reported (set after an adapter load)
    POST /pause_generation, /continue_generation
    POST /release_memory_occupation, /resume_memory_occupation, /flush_cache
    POST /get_weights_checksum                       sha256 of the loaded tensors (SGLang diffusion's API)

Every route but the two GETs needs `Authorization: Bearer <token>` (constant-time compare); the
token is never logged. Then each request passes the server's limits (stages/engines/limits.py:
body bytes read with a cap, requests in flight) before any route parses it. Errors are JSON
{"success": false, "message": ...} with status 400; over a limit 413 or 400 (or 503 with Retry-After
for requests in flight), with "limit" naming the setting.
"""
from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.engine_server.update_group import UpdateGroups
from unirl.stages.engines.client import tensor_to_wire
from unirl.stages.engines.limits import LimitError, Limits, RequestGate, required, text_field, version_text
from unirl.stages.runtime.registry import load_object

log = logging.getLogger("unirl.engine_server")
OPEN_ROUTES = {"/health", "/health_generate", "/model_info", "/get_model_info"}
GENERATION_ROUTES = {"/generate", "/rollout/generate"}


def create_app(core: EngineCore, token: str | None, *, max_batch: int = 64, batch_wait_s: float = 0.005,
               limits: Limits | None = None) -> FastAPI:
    """The app over `core`. `token` None: no auth (only when the operator turned it off)."""
    limits = limits or Limits()
    app = FastAPI(title="unirl engine server", docs_url=None, redoc_url=None, openapi_url=None)
    # The policy's backend answers its SGLang route (text: /generate, flow: /rollout/generate).
    backend = load_object(core.policy.server_backend).serve(core, max_batch=max_batch, wait_s=batch_wait_s, limits=limits)
    text = backend if backend.route == "/generate" else None
    flow = backend if backend.route == "/rollout/generate" else None
    groups = UpdateGroups(core)
    app.state.core, app.state.backend, app.state.limits = core, backend, limits
    app.state.in_flight = {"generation": 0, "other": 0}
    # Added before the token check, so it runs inside it: an unauthenticated body is never read.
    app.add_middleware(RequestGate, limits=limits, generation=GENERATION_ROUTES, open_routes=OPEN_ROUTES,
                       in_flight=app.state.in_flight)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if token is not None and request.url.path not in OPEN_ROUTES:
            scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                return JSONResponse({"success": False, "message": "missing or wrong bearer token"}, 401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(EngineRequestError)
    async def bad_request(request: Request, exc: EngineRequestError) -> JSONResponse:
        if isinstance(exc, LimitError):
            return JSONResponse({"success": False, "message": str(exc), "limit": exc.setting}, exc.status)
        return JSONResponse({"success": False, "message": str(exc)}, 400)

    @app.exception_handler(RequestValidationError)
    async def not_an_object(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"success": False, "message": "the request body must be a JSON object"}, 400)

    @app.exception_handler(HTTPException)  # starlette's: FastAPI raises it for a body it cannot parse, 404, 405
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc.detail)}, exc.status_code, headers=exc.headers)

    def refused(exc: Exception) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc)}, 400)

    @app.get("/health")
    @app.get("/health_generate")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    def model_info() -> dict[str, Any]:
        return {"model_path": core.model_path, "weight_version": core.version, "is_generation": True,
                "model_type": core.recipe.model.kind}

    @app.post("/generate")
    def generate(body: dict[str, Any]) -> Any:
        if text is None:
            raise EngineRequestError(f"this engine serves a {core.policy.kind} model: POST {backend.route}")
        if body.get("stream"):
            raise EngineRequestError("stream: the engine server answers whole responses only")
        requests = text.parse(body)
        out = text.submit(requests)
        return out if isinstance(body["input_ids"][0], list) else out[0]

    @app.post("/rollout/generate")
    async def rollout_generate(body: dict[str, Any]) -> Response:
        import msgpack  # start-up time: msgpack loads on first use, not when a recipe is read

        if flow is None:
            raise EngineRequestError(f"this engine serves a {core.policy.kind} model: POST {backend.route}")
        out = await flow.submit(body)  # a batch member waits without a worker thread (FlowBackend.submit)
        payload = await run_in_threadpool(tensor_to_wire, out)
        return Response(msgpack.packb(payload, use_bin_type=True), media_type="application/msgpack")

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: dict[str, Any]) -> JSONResponse:
        try:
            version = body.get("weight_version")
            info = core.update_from_disk(text_field(required(body, "model_path"), "model_path"),
                                         None if version is None else version_text(version, "weight_version"))
        except EngineRequestError as exc:
            return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
        log.info("weights %s loaded in %.3fs (version %s)", body["model_path"], info["seconds"], core.version)
        return JSONResponse({"success": True, "message": f"Succeeded to update model weights (version {core.version}, "
                             f"manifest sha256 {info['manifest_sha256']}).", "num_paused_requests": 0})

    @app.post("/init_weights_update_group")
    def init_weights_update_group(body: dict[str, Any]) -> JSONResponse:
        try:
            groups.init(body)
        except (EngineRequestError, RuntimeError) as exc:
            return refused(exc)
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    @app.post("/update_weights_from_distributed")
    def update_weights_from_distributed(body: dict[str, Any]) -> JSONResponse:
        try:
            groups.receive(body)
        except (EngineRequestError, RuntimeError) as exc:
            return refused(exc)
        return JSONResponse({"success": True, "message": f"Succeeded to update parameter online (version {core.version})."})

    @app.post("/destroy_weights_update_group")
    def destroy_weights_update_group(body: dict[str, Any]) -> JSONResponse:
        groups.destroy(text_field(body.get("group_name", "weight_update_group"), "group_name"))
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    @app.post("/update_weight_version")
    def update_weight_version(body: dict[str, Any]) -> JSONResponse:
        version = version_text(required(body, "new_version"), "new_version")
        with core.lock:
            core.version = version
        return JSONResponse({"success": True, "message": f"Weight version updated to {core.version}",
                             "new_version": core.version})

    @app.post("/load_lora_adapter")
    def load_lora_adapter(body: dict[str, Any]) -> JSONResponse:
        try:
            core.load_adapter(text_field(required(body, "lora_name"), "lora_name"), text_field(required(body, "lora_path"), "lora_path"))
        except EngineRequestError as exc:
            return JSONResponse({"success": False, "error_message": str(exc)}, 400)
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": dict(core.adapters)})

    @app.post("/unload_lora_adapter")
    def unload_lora_adapter(body: dict[str, Any]) -> JSONResponse:
        try:
            core.unload_adapter(text_field(required(body, "lora_name"), "lora_name"))
        except EngineRequestError as exc:
            return JSONResponse({"success": False, "error_message": str(exc)}, 400)
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": dict(core.adapters)})

    @app.post("/pause_generation")
    def pause_generation(body: dict[str, Any]) -> JSONResponse:
        core.pause()
        if body.get("mode", "abort") == "abort" and text is not None:
            text.abort_queued()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    def continue_generation(body: dict[str, Any] | None = None) -> JSONResponse:
        core.resume_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/release_memory_occupation")
    def release_memory_occupation(body: dict[str, Any] | None = None) -> Response:
        core.release_memory()
        return Response(status_code=200)

    @app.post("/resume_memory_occupation")
    def resume_memory_occupation(body: dict[str, Any] | None = None) -> Response:
        start = time.perf_counter()
        core.resume_memory()
        log.info("memory resumed in %.3fs", time.perf_counter() - start)
        return Response(status_code=200)

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    def flush_cache() -> Response:
        if core.policy is not None and hasattr(core.policy, "prompts"):
            core.policy.prompts._cache.clear()
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/get_weights_checksum")
    def get_weights_checksum(body: dict[str, Any]) -> dict[str, str]:
        names = body.get("module_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise EngineRequestError("module_names must be a list of names")
        return core.checksum(names)

    return app

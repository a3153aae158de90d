"""The reward server: scorers loaded once, served over authenticated HTTP (FastAPI + uvicorn).

    POST /v1/score   Arrow IPC stream body (see `unirl.stages.rewards.wire`) -> JSON totals + components
    GET  /healthz    {"status": "ok", "scorers": [...], "aggregation": ..., "in_flight": n}; no token

Status codes of /v1/score, each with a JSON body {"error": "<what went wrong>"}:
    400 malformed Arrow / columns / media / metadata, or input a scorer cannot score (it raised ValueError)
    401 missing or wrong bearer token
    413 over a size limit: max_body_bytes, max_rows, max_decoded_bytes, max_images, max_pixels, max_metadata_bytes
    500 a scorer failed otherwise or returned a non-finite value
    503 too many requests queued           504 scoring took longer than timeout_s
A scorer's 400 or 500 also carries {"scorer": "<key>"}; a failure is never turned into a zero score.
Started by `unirl reward-server --config FILE` (flows/reward_server.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from unirl.stages.rewards.base import ScoreBatch, Scorer, ScorerError, ScoreResult, aggregate, build_scorer, run_scorer, scorer_reads
from unirl.stages.rewards.wire import Limits, TooLarge, WireError, decode_batch, result_to_json
from unirl.stages.runtime.secrets import RedactingFilter
from unirl.stages.runtime.yaml_input import MAX_BYTES as YAML_MAX_BYTES
from unirl.stages.runtime.yaml_input import YamlInputError, load_yaml

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # hosts where `auth: false` is allowed without `insecure: true`


class ConfigError(ValueError):
    """The server config is invalid; the message names the file and the field."""


class ScorerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registered scorer name, e.g. clip, pickscore, text_length")
    key: str | None = Field(None, description="label in the response components (default: name)")
    weight: float = Field(1.0, description="weight in weighted_sum aggregation")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword args of the scorer, e.g. model_path")

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("weight must be finite")
        return v

    @property
    def label(self) -> str:
        return self.key or self.name


class ServerConfig(BaseModel):
    """Everything `unirl reward-server` needs; loaded from YAML or JSON."""

    model_config = ConfigDict(extra="forbid")

    scorers: list[ScorerSpec] = Field(min_length=1, description="scorers run on every request")
    aggregation: Literal["weighted_sum", "mean", "min", "max"] = "weighted_sum"
    host: str = Field("127.0.0.1", description="bind address; loopback by default")
    port: int = Field(8765, ge=1, le=65535)
    auth: bool = Field(True, description="require a bearer token; false only when set explicitly, and on a loopback host")
    insecure: bool = Field(False, description="allow `auth: false` on a non-loopback host (logged as a warning at start)")
    token_env: str = Field("UNIRL_REWARD_TOKEN", description="env var that holds the bearer token")
    max_body_bytes: int = Field(64 * 2**20, gt=0, description="larger request bodies get 413")
    max_rows: int = Field(Limits.max_rows, gt=0, description="samples per request; more get 413")
    max_decoded_bytes: int = Field(Limits.max_decoded_bytes, gt=0,
                                   description="Arrow data of a request once decompressed, from its batch headers; more get 413")
    max_images: int = Field(Limits.max_images, gt=0, description="images plus video frames per request; more get 413")
    max_pixels: int = Field(Limits.max_pixels, gt=0,
                            description="width * height summed over a request's images and frames, from their headers; more get 413")
    max_metadata_bytes: int = Field(Limits.max_metadata_bytes, gt=0, description="metadata JSON of all samples of a request; more get 413")
    max_metadata_depth: int = Field(Limits.max_metadata_depth, gt=0, description="nesting of one sample's metadata JSON; deeper get 400")
    timeout_s: float = Field(120.0, gt=0, description="per request, queueing included; then 504")
    max_concurrency: int = Field(2, ge=1, description="requests scored at the same time")
    max_queue: int = Field(128, ge=0, description="requests waiting beyond max_concurrency; more get 503")
    imports: list[str] = Field(default_factory=list, description="modules imported first, to register custom scorers")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @model_validator(mode="after")
    def _unique_labels(self) -> ServerConfig:
        labels = [s.label for s in self.scorers]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"scorer key {label!r} is used twice; give one of them a distinct `key`")
            if "/" in label:
                raise ValueError(f"scorer key {label!r} must not contain '/'")
        return self


def load_config(path: str | Path, **overrides: Any) -> ServerConfig:
    """Read a YAML (or .json) server config; `overrides` (e.g. port=...) replace top-level fields."""
    path = Path(path)
    try:
        with path.open("rb") as f:  # no more than the bound: a huge file is refused unread
            text = f.read(YAML_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read reward server config {path}: {exc}") from exc
    try:
        if path.suffix == ".json":
            if len(text) > YAML_MAX_BYTES:
                raise ConfigError(f"{path}: more than {YAML_MAX_BYTES} bytes")
            raw = json.loads(text)
        else:
            raw = load_yaml(text, str(path))
    except YamlInputError as exc:
        raise ConfigError(str(exc)) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServerConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc


def resolve_token(config: ServerConfig) -> str | None:
    """The bearer token from the config's env var, or None when auth is explicitly off: on a
    loopback host, or on another with `insecure: true`."""
    if not config.auth:
        if config.host in LOOPBACK:
            return None
        if not config.insecure:
            raise ConfigError(
                f"auth: false with host {config.host}: anyone who reaches it could use the scorers; "
                "serve loopback only without a token, or set `insecure: true` to accept that"
            )
        log.warning("INSECURE: auth is off and the server binds %s: anyone who can reach it can use the scorers "
                    "(`insecure: true` in the config)", config.host)
        return None
    token = os.environ.get(config.token_env, "")
    if not token:
        raise ConfigError(
            f"auth is on but ${config.token_env} is empty: export a token there, "
            "or set `auth: false` in the config (loopback only)"
        )
    return token


class ScoringService:
    """Owns the built scorers and the worker threads that run them (at most `max_concurrency`)."""

    def __init__(self, config: ServerConfig) -> None:
        for module in config.imports:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"imports: cannot import {module!r}: {exc}") from exc
        self.config = config
        self.scorers: dict[str, Scorer] = {}
        for i, spec in enumerate(config.scorers):
            try:
                self.scorers[spec.label] = build_scorer(spec.name, **spec.params)
            except Exception as exc:  # noqa: BLE001 - reported with the config path
                raise ConfigError(f"scorers.{i} ({spec.label}): {type(exc).__name__}: {exc}") from exc
        self.weights = {s.label: s.weight for s in config.scorers}
        self.limits = Limits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Limits)})
        # The media the scorers read: an image or video column no scorer reads is not decoded.
        reads = [scorer_reads(spec.name) for spec in config.scorers]
        self.reads = None if None in reads else {media for r in reads if r is not None for media in r}
        self.executor = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="scorer")
        self._pending = 0
        self._lock = threading.Lock()

    def score(self, batch: ScoreBatch) -> ScoreResult:
        """Run every scorer (validated by run_scorer) and aggregate. Raises _ScorerFailure."""
        results = {}
        for label, scorer in self.scorers.items():
            try:
                results[label] = run_scorer(scorer, batch)
            except ScorerError as exc:
                # Scorers raise ValueError for a sample they cannot score (no `answer` metadata, no
                # text or images): the request's fault, which a retry cannot mend.
                raise _ScorerFailure(label, str(exc), bad_input=isinstance(exc.__cause__, ValueError)) from exc
        return aggregate(results, self.weights, self.config.aggregation)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished: queued, running, or timed out but still running."""
        return self._pending

    def try_admit(self) -> bool:
        """Reserve a slot for one request; False when running + queued is at its bound."""
        with self._lock:
            if self._pending >= self.config.max_concurrency + self.config.max_queue:
                return False
            self._pending += 1
            return True

    def release(self, _: object = None) -> None:
        with self._lock:
            self._pending -= 1


class _ScorerFailure(RuntimeError):
    def __init__(self, label: str, message: str, bad_input: bool) -> None:
        super().__init__(message)
        self.label, self.bad_input = label, bad_input


class _HttpError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra


def _check_token(authorization: str | None, token: str | None) -> None:
    if token is None:
        return
    if not authorization:
        raise _HttpError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise _HttpError(401, "invalid bearer token")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _HttpError(413, f"body of {declared} bytes exceeds max_body_bytes={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _HttpError(413, f"body exceeds max_body_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode_and_score(service: ScoringService, body: bytes) -> dict[str, Any]:
    try:
        batch = decode_batch(body, service.limits, service.reads)
    except TooLarge as exc:
        raise _HttpError(413, f"request too large: {exc}") from exc
    except WireError as exc:
        raise _HttpError(400, f"malformed request: {exc}") from exc
    try:
        result = service.score(batch)
    except _ScorerFailure as exc:
        raise _HttpError(400 if exc.bad_input else 500, str(exc), scorer=exc.label) from exc
    return result_to_json(batch.sample_ids, result, service.config.aggregation)


def create_app(service: ScoringService, token: str | None) -> FastAPI:
    """The FastAPI app. `token` None means no auth (only when the config says `auth: false`)."""
    config = service.config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        service.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="unirl reward server", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    async def admit_and_score(request: Request, deadline: float) -> dict[str, Any]:
        if not service.try_admit():
            raise _HttpError(503, "server busy: too many queued requests, retry later")
        try:
            body = await asyncio.wait_for(_read_body(request, config.max_body_bytes),
                                          deadline - time.monotonic())
            job = service.executor.submit(_decode_and_score, service, body)
        except BaseException:
            service.release()
            raise
        # The slot is held until the worker thread finishes, even after a 504, so timed-out work
        # still counts against max_concurrency + max_queue.
        job.add_done_callback(service.release)
        # On timeout wait_for cancels the job if it is still queued; a running scorer cannot be
        # interrupted and finishes in the background.
        return await asyncio.wait_for(asyncio.wrap_future(job), max(deadline - time.monotonic(), 0.0))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "scorers": list(service.scorers), "aggregation": config.aggregation,
                "in_flight": service.in_flight}

    @app.post("/v1/score")
    async def score(request: Request) -> JSONResponse:
        start = time.monotonic()
        try:
            _check_token(request.headers.get("authorization"), token)
            payload = await admit_and_score(request, start + config.timeout_s)
        except asyncio.TimeoutError:
            exc = _HttpError(504, f"request took longer than timeout_s={config.timeout_s}")
        except _HttpError as err:
            exc = err
        except Exception as err:  # noqa: BLE001 - a bug must still answer with a message
            log.exception("POST /v1/score failed")
            exc = _HttpError(500, f"internal error: {type(err).__name__}: {err}")
        else:
            log.debug("scored %d samples in %.3fs", len(payload["sample_ids"]), time.monotonic() - start)
            return JSONResponse(payload)
        if exc.status >= 500:
            log.error("POST /v1/score -> %d: %s", exc.status, exc)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": str(exc), **exc.extra}, exc.status, headers=headers)

    return app


def serve(config: ServerConfig) -> None:
    """Resolve the token, build the scorers, and serve until interrupted (SIGINT / SIGTERM)."""
    import uvicorn  # start-up time: uvicorn loads on first use, not when a recipe is read
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    token = resolve_token(config)
    # Pillow's own guard against decompression bombs, for an image opened anywhere in this process:
    # past twice this it refuses to open one (wire.py checks every request's headers against max_pixels first).
    Image.MAX_IMAGE_PIXELS = config.max_pixels
    service = ScoringService(config)
    app = create_app(service, token)
    log.info("reward server on http://%s:%d scorers=%s aggregation=%s",
             config.host, config.port, list(service.scorers), config.aggregation)
    # A client that puts its token in the URL by mistake must not leave it in the access log.

    logging.getLogger("uvicorn.access").addFilter(RedactingFilter())
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)

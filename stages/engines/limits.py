"""What one request may ask of the engine server, checked at its edge before anything heavy runs:
body bytes, prompts and tokens, samples, steps and requests in flight (docs/engines.md lists them).
Every limit is a server setting (`unirl engine-server --max-...`, or the launch spec's key of the
same name); a request over one is refused with 413 (too large) or 400 (a value over its cap) and a
JSON error naming the limit and its setting, so one careless client cannot grow the process until
the OOM killer ends it for everyone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

SEED_BOUND = 1 << 63  # seeds are 63-bit (stages/runtime/seeds.py); torch takes < 2**64, and flow adds the output index


class EngineRequestError(ValueError):
    """A request the engine cannot serve (HTTP 400 with the message)."""


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 16 << 20  # request body
    max_prompts: int = 4096  # prompts of one /generate
    max_new_tokens: int = 4096  # per prompt; prompt + max_new_tokens must also fit the model's context
    max_steps: int = 1000  # a flow request's num_inference_steps
    max_concurrent: int = 64  # generation requests in flight, and apart from them other requests in flight

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")


class LimitError(EngineRequestError):
    """A request over a limit: `setting` is the server setting that raises it."""

    def __init__(self, message: str, setting: str, status: int):
        super().__init__(f"{message} (setting {setting})")
        self.setting, self.status = setting, status


def over(what: str, value: int, limit: str, cap: int, status: int = 400) -> LimitError:
    """`what` (`value`) is over the limit `limit` (a Limits field, or max_batch) of `cap`."""
    return LimitError(f"{what}: {value} is over this engine's limit of {cap}", Limits.flag(limit), status)


def over_context(what: str, context: int, status: int) -> LimitError:
    """`what` does not fit the served model's context of `context` tokens."""
    return LimitError(f"{what}: does not fit the served model's context of {context} tokens", "max_position_embeddings "
                      "in the served model's config.json", status)


def shown(value: Any, length: int = 40) -> str:
    """A client's value in an error message, cut short: the message must not grow with the request."""
    text = repr(value)
    return text if len(text) <= length else text[:length - 3] + "..."


def integer(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an integer in [low, high) (not a bool, not a float): else a 400 naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise EngineRequestError(f"{name}: {shown(value)} is not an integer in [{low}, {high})")
    return value


def number(value: Any, name: str, low: float, high: float) -> float:
    """`value` as a finite number in [low, high]: else a 400 naming `name`."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high
    except OverflowError:  # an integer beyond any float
        ok = False
    if not ok:
        raise EngineRequestError(f"{name}: {shown(value)} is not a number in [{low}, {high}]")
    return float(value)


def text_field(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise EngineRequestError(f"{name}: {shown(value)} is not a string")
    return value


def version_text(value: Any, name: str) -> str:
    """A weight version as the engine reports it on every answer: a short string (or a number)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or len(str(value)) > 128:
        raise EngineRequestError(f"{name}: {shown(value)} is not a version (a string of at most 128 characters)")
    return str(value)


def required(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise EngineRequestError(f"{name} is required")
    return body[name]


class RequestGate:
    """ASGI middleware (inside the token check): counts requests in flight and reads each body
    with a cap before any route parses it.

    A generation request (`generation` routes) beyond `max_concurrent` in flight is answered 503
    with Retry-After; other requests are counted apart, so an engine full of held generation
    requests can still be paused, continued and given weights. A body is refused with 413 as soon
    as its declared Content-Length or the bytes actually read pass `max_request_bytes` (chunked
    bodies declare none, and a declaration can lie); the rest of it is never buffered."""

    def __init__(self, app: Any, limits: Limits, generation: set[str], open_routes: set[str], in_flight: dict[str, int]):
        self.app, self.limits, self.generation, self.open_routes = app, limits, generation, open_routes
        self.in_flight = in_flight  # {"generation": n, "other": n}, the app's; touched only on the event loop

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_routes:
            await self.app(scope, receive, send)
            return
        kind = "generation" if scope["path"] in self.generation else "other"
        if self.in_flight[kind] >= self.limits.max_concurrent:
            await refuse(send, 503, f"{kind} requests: {self.in_flight[kind]} in flight already, this engine's limit; "
                         "retry shortly", Limits.flag("max_concurrent"), retry_after=1)
            return
        self.in_flight[kind] += 1
        try:
            body = await self.read_body(scope, receive, send)
            if body is not None:
                await self.app(scope, replay(body, receive), send)
        finally:
            self.in_flight[kind] -= 1

    async def read_body(self, scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
        """The whole body, or None when it was refused (413 sent) or the client went away."""
        cap = self.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        # h11 refuses a Content-Length that is not a number; a long one is over any cap (and int() of it slow)
        if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
            await refuse(send, 413, f"request body: {declared.decode()[:24]} bytes declared, over this engine's limit "
                         f"of {cap} bytes", Limits.flag("max_request_bytes"))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await refuse(send, 413, f"request body: more than {cap} bytes, over this engine's limit",
                             Limits.flag("max_request_bytes"))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive: Any) -> Any:
    """An ASGI `receive` that hands the app `body` once, then waits on the client (disconnects)."""
    sent = False

    async def receive_again() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


async def refuse(send: Any, status: int, message: str, setting: str, retry_after: int | None = None) -> None:
    """A limit's JSON answer sent straight from the middleware."""
    payload = json.dumps({"success": False, "message": f"{message} (setting {setting})", "limit": setting}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

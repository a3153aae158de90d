"""Engine servers for tests: the real app (stages/engine_server/app.py) over real HTTP on
127.0.0.1, in a thread of the test process (uvicorn), with a tiny model from tests/tiny.py."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN = "test-engine-token"


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """`app` served on a free loopback port until the block ends; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def engine_server(recipe: Any, weights: Path, *, token: str | None = TOKEN, version: str = "0", **options: Any) -> Iterator[tuple[str, Any]]:
    """(url, core) of an engine server serving `weights` for `recipe`."""
    from unirl.stages.engine_server.app import create_app
    from unirl.stages.engine_server.core import EngineCore

    core = EngineCore(recipe, weights, version)
    with serve_app(create_app(core, token, **options)) as url:
        yield url, core

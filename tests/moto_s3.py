"""moto's S3 server on a free loopback port, for the tests that run against s3:// (docs/contributing.md):
`with moto_endpoint() as url:` gives its endpoint URL and stops it after."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()

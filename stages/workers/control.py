"""The worker group's control channel: one JSON command per TCP connection on loopback, carrying
a shared token; rank 0 relays each command to every rank as JSON bytes (no pickles).

Wire format (both ways): one UTF-8 JSON object terminated by a newline.
request:  {"token": "...", "cmd": "train", "args": {...}}
response: {"ok": true, "result": {...}} | {"ok": false, "error": "traceback text"}
"""
from __future__ import annotations

import hmac
import json
import socket
from typing import Any

from unirl.stages.train.collectives import all_gather_json, broadcast_json  # noqa: F401 (re-exported)

NOOP = {"cmd": "noop", "args": {}}


def send_json(sock: socket.socket, obj: Any) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def recv_json(sock: socket.socket, limit: int = 64 * 1024 * 1024) -> Any:
    chunks = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > limit:
            raise ValueError("control message too large")
    data = b"".join(chunks)
    if not data:
        raise ConnectionError("control channel closed before a message arrived")
    return json.loads(data)


class ControlServer:
    """Rank 0's listening socket. `next_command` returns a checked command, or NOOP after
    `idle_s` without one (so every rank wakes up regularly and collectives never time out)."""

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0):
        self.token = token
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self._conn: socket.socket | None = None

    def next_command(self, idle_s: float = 20.0) -> dict[str, Any]:
        self.sock.settimeout(idle_s)
        while True:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                return dict(NOOP)
            conn.settimeout(60)
            try:
                msg = recv_json(conn)
            except (ValueError, ConnectionError, OSError):
                conn.close()
                continue
            if not isinstance(msg, dict) or not hmac.compare_digest(str(msg.get("token", "")), self.token):
                try:
                    send_json(conn, {"ok": False, "error": "unauthorized: wrong or missing control token"})
                finally:
                    conn.close()
                continue
            conn.settimeout(None)
            self._conn = conn
            return {"cmd": str(msg.get("cmd")), "args": msg.get("args") or {}}

    def reply(self, obj: dict[str, Any]) -> None:
        if self._conn is None:
            return
        try:
            send_json(self._conn, obj)
        except OSError:
            pass  # the client went away; its next call sees the group's state
        finally:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.sock.close()



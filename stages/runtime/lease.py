"""One owner per run: `lease.json` in the run folder names the process that runs it (host, pid,
start time, a random token) and its heartbeat, refreshed every `HEARTBEAT_S`. A second `unirl
run` of the same run refuses, naming the owner. A lease left by a killed owner is taken over:
on the same host when its pid is gone (or is another process now), on another host when its
heartbeat is older than `STALE_S`.

The same protocol on local disk and object storage (where there is no atomic create): write the
lease, wait `SETTLE_S`, read it back; of two processes that raced, the one whose token is not in
the file steps back with the same error.
"""
from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

LEASE = "lease.json"
HEARTBEAT_S = 10.0
STALE_S = 60.0
SETTLE_S = 0.3


class RunBusyError(RuntimeError):
    """The run is being run by another live process."""


def _describe(owner: dict[str, Any]) -> str:
    started = datetime.fromtimestamp(owner.get("started", 0), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"host {owner.get('host')!r}, pid {owner.get('pid')}, started {started}"


def _alive_here(owner: dict[str, Any]) -> bool:
    """Whether the owner's process (on this host) still runs: its pid exists and started no later
    than the lease (a pid reused by a newer process is not the owner)."""
    import psutil

    try:
        proc = psutil.Process(int(owner["pid"]))
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= owner["started"] + 1.0
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


class RunLease:
    """Hold the lease of the run in `storage` while the block runs; `log` says when a stale one is
    taken over."""

    def __init__(self, storage: Any, log: Callable[[str], None] = print, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S):
        self.storage, self.log = storage, log
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                      "token": secrets.token_hex(8)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def held_by_other(self) -> dict[str, Any] | None:
        """The current owner when it is another live process, else None (free or stale)."""
        if not self.storage.exists(LEASE):
            return None
        try:
            lease = self.storage.read_json(LEASE)
            owner = lease["owner"]
        except (ValueError, KeyError, OSError):
            return None  # a half-written or foreign file is no lease
        if owner.get("token") == self.owner["token"]:
            return None
        if owner.get("host") == self.owner["host"]:
            alive = _alive_here(owner)
        else:
            alive = time.time() - float(lease.get("heartbeat", 0)) < self.stale_s
        if alive:
            return owner
        self.log(f"taking over the lease of {self.storage.url()} left by {_describe(owner)}, which is gone")
        return None

    def _write(self) -> None:
        self.storage.write_json(LEASE, {"owner": self.owner, "heartbeat": time.time()})

    def acquire(self) -> RunLease:
        owner = self.held_by_other()
        if owner is None:
            self._write()
            time.sleep(SETTLE_S)
            current = self.storage.read_json(LEASE)["owner"]
            owner = None if current.get("token") == self.owner["token"] else current
        if owner is not None:
            raise RunBusyError(
                f"run {self.storage.run!r} at {self.storage.url()} is being run by {_describe(owner)}; wait for it, "
                "stop it, or pick another --run-name (a lease whose process is gone is taken over by the next run)"
            )
        self._thread = threading.Thread(target=self._beat, name="unirl-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write()
            except Exception as exc:  # noqa: BLE001 - storage down for a while: the next beat retries
                self.log(f"lease heartbeat of {self.storage.url()} failed: {exc}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self.storage.exists(LEASE) and self.storage.read_json(LEASE)["owner"].get("token") == self.owner["token"]:
                self.storage.remove(LEASE)
        except Exception:  # noqa: BLE001 - a lease that outlives us is stale at the next start
            pass

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

"""One owner per run: `lease.json` in the run folder names the process that runs it (host, pid,
start time, a random token) and its heartbeat, refreshed every `HEARTBEAT_S`. A second `unirl
run` of the same run refuses, naming the owner. A lease left by a killed owner is taken over:
on the same host when its pid is gone (or is another process now), on another host when its
heartbeat is older than `STALE_S`.

Every change of the lease is a compare-and-swap on the storage (stages/runtime/storage.py,
`create_new` / `replace_tagged` / `remove_tagged`: an exclusive create and a flock on local disk,
conditional requests on S3), so of two processes that race exactly one wins, with no settling
delay: taking a free lease is an exclusive create, taking over a stale one a replace of the very
version that was judged stale, and the heartbeat a replace of the version this owner wrote last.
A heartbeat that finds another owner (this process was paused past `STALE_S` and its lease taken
over) stops beating and marks the lease lost; the run checks `held()` before every commit and stops
there, naming who holds the run now.
"""
from __future__ import annotations

import json
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
_HELD: dict[str, list[RunLease]] = {}  # the leases this process holds, by run folder URL


def check_held(url: str) -> None:
    """Before a commit to the run folder `url`: raise LeaseLostError if this process held the run's
    lease and another process has taken it over (no lease held here: nothing to check)."""
    for lease in _HELD.get(url, []):
        lease.held()


class RunBusyError(RuntimeError):
    """The run is being run by another live process."""


class LeaseLostError(RuntimeError):
    """Another process took the run's lease over while this one held it (this one was paused or cut
    off from the storage for longer than the lease lives): it must not commit anything more."""


def _describe(owner: dict[str, Any]) -> str:
    started = datetime.fromtimestamp(owner.get("started", 0), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"host {owner.get('host')!r}, pid {owner.get('pid')}, started {started}"


def _alive_here(owner: dict[str, Any]) -> bool:
    """Whether the owner's process (on this host) still runs: its pid exists and started no later
    than the lease (a pid reused by a newer process is not the owner)."""
    import psutil  # start-up time: psutil loads on first use, not when a recipe is read

    try:
        proc = psutil.Process(int(owner["pid"]))
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= owner["started"] + 1.0
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def _parse(data: bytes) -> dict[str, Any] | None:
    """A lease's content, or None for a file that is no lease (foreign, or not JSON)."""
    try:
        lease = json.loads(data)
        return lease if isinstance(lease, dict) and isinstance(lease.get("owner"), dict) else None
    except (ValueError, UnicodeDecodeError):
        return None


class RunLease:
    """Hold the lease of the run in `storage` while the block runs; `log` says when a stale one is
    taken over."""

    def __init__(self, storage: Any, log: Callable[[str], None] = print, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S):
        self.storage, self.log = storage, log
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                      "token": secrets.token_hex(8)}
        self.tag: str | None = None  # the version of the lease this owner wrote last
        self.lost_to: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _data(self) -> bytes:
        return (json.dumps({"owner": self.owner, "heartbeat": time.time()}, indent=2, sort_keys=True) + "\n").encode()

    def _live(self, lease: dict[str, Any]) -> bool:
        """Whether the lease's owner (another process) still holds it."""
        owner = lease["owner"]
        if owner.get("host") == self.owner["host"]:
            return _alive_here(owner)
        return time.time() - float(lease.get("heartbeat", 0)) < self.stale_s

    def _busy(self, owner: dict[str, Any]) -> RunBusyError:
        return RunBusyError(
            f"run {self.storage.run!r} at {self.storage.url()} is being run by {_describe(owner)}; wait for it, "
            "stop it, or pick another --run-name (a lease whose process is gone is taken over by the next run)")

    def acquire(self) -> RunLease:
        """Take the lease (free, or stale and taken over) or raise RunBusyError naming its owner."""
        for _ in range(8):  # each lost race means another process changed the lease: read it again
            got = self.storage.read_tagged(LEASE)
            if got is None:
                self.tag = self.storage.create_new(LEASE, self._data())
                if self.tag is None:
                    continue  # created by another process just now
                break
            data, tag = got
            lease = _parse(data)
            if lease is not None and lease["owner"].get("token") == self.owner["token"]:
                self.tag = tag  # our own write, whose answer a retry lost
                break
            if lease is not None and self._live(lease):
                raise self._busy(lease["owner"])
            self.tag = self.storage.replace_tagged(LEASE, self._data(), tag)
            if self.tag is None:
                continue  # another process took it over first
            what = _describe(lease["owner"]) if lease is not None else "a file that is no lease"
            self.log(f"taking over the lease of {self.storage.url()} left by {what}, which is gone")
            break
        else:
            raise RuntimeError(f"the lease of {self.storage.url()} kept changing while this process tried to take it; "
                               "another process is starting the same run: try again")
        _HELD.setdefault(self.storage.url(), []).append(self)
        self._thread = threading.Thread(target=self._beat, name="unirl-lease", daemon=True)
        self._thread.start()
        return self

    def renew(self) -> bool:
        """Refresh the heartbeat if this process still owns the lease; False (and `lost_to` set)
        when another process has taken it over."""
        with self._lock:
            if self.lost_to is not None or self.tag is None:
                return self.lost_to is None
            new = self.storage.replace_tagged(LEASE, self._data(), self.tag)
            if new is not None:
                self.tag = new
                return True
            got = self.storage.read_tagged(LEASE)
            lease = _parse(got[0]) if got is not None else None
            if lease is not None and lease["owner"].get("token") == self.owner["token"]:
                self.tag = got[1]  # our own write, whose answer a retry lost
                return True
            self.lost_to = lease["owner"] if lease is not None else {"host": "?", "pid": "?", "started": 0}
            self.log(f"the lease of {self.storage.url()} was taken over by {_describe(self.lost_to)}; this process "
                     "stops before its next commit")
            return False

    def held(self) -> None:
        """Raise LeaseLostError if another process has taken the lease over: called before a commit."""
        if self.lost_to is not None:
            raise LeaseLostError(
                f"run {self.storage.run!r} at {self.storage.url()} is now run by {_describe(self.lost_to)}: this "
                "process was paused or cut off from the storage for longer than its lease lives "
                f"({self.stale_s:.0f} s) and the run was taken over; it stopped before committing anything more")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - storage down for a while: the next beat retries
                self.log(f"lease heartbeat of {self.storage.url()} failed: {exc}")

    def release(self) -> None:
        held = _HELD.get(self.storage.url(), [])
        if self in held:
            held.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self.lost_to is None and self.tag is not None:
                try:
                    self.storage.remove_tagged(LEASE, self.tag)
                except Exception:  # noqa: BLE001 - a lease that outlives us is stale at the next start
                    pass
            self.tag = None

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

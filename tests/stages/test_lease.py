"""One owner per run: a second process refuses naming the owner; a lease whose owner is gone is
taken over; of starts in the same instant exactly one wins; an owner whose lease was taken over
while it was paused stops before its next commit; on local disk and on S3 (moto's server,
conditional requests)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from unirl.stages.runtime.lease import LEASE, RunBusyError, RunLease
from unirl.stages.runtime.storage import RunStorage


def other_process_lease(storage: RunStorage, **owner) -> None:
    storage.write_json(LEASE, {"owner": {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                                         "token": "someone-else", **owner}, "heartbeat": time.time()})


@pytest.fixture(scope="module")
def moto_endpoint():
    from tests.moto_s3 import moto_endpoint

    with moto_endpoint() as url:
        yield url


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return RunStorage(str(tmp_path), "run")
    import s3fs

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": request.getfixturevalue("moto_endpoint")}}
    bucket = f"leases-{abs(hash(str(tmp_path))) % 10**8}"  # moto keeps buckets for the whole process
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return RunStorage(f"s3://{bucket}/team", "run", options)


def test_a_live_owner_keeps_the_run_and_is_named(storage):
    other_process_lease(storage)  # this very process, under another token: alive
    with pytest.raises(RunBusyError) as info:
        RunLease(storage).acquire()
    message = str(info.value)
    assert f"run 'run' at {storage.url()} is being run by host {socket.gethostname()!r}, pid {os.getpid()}, started " in message
    assert "--run-name" in message


def test_a_lease_of_a_dead_process_is_taken_over_and_released(storage):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other_process_lease(storage, pid=dead.pid)
    said = []
    lease = RunLease(storage, log=said.append).acquire()
    assert storage.read_json(LEASE)["owner"]["token"] == lease.owner["token"]
    assert said and "taking over the lease" in said[0] and f"pid {dead.pid}" in said[0]
    lease.release()
    assert not storage.exists(LEASE)


def test_a_reused_pid_is_not_the_owner(storage):
    other_process_lease(storage, started=time.time() - 10 * 86400)  # our pid, but we started after that lease
    RunLease(storage).acquire().release()


def test_another_hosts_lease_counts_until_its_heartbeat_is_stale(storage):
    storage.write_json(LEASE, {"owner": {"host": "node-7", "pid": 1, "started": time.time(), "token": "t"},
                               "heartbeat": time.time()})
    with pytest.raises(RunBusyError, match="host 'node-7', pid 1"):
        RunLease(storage).acquire()
    storage.write_json(LEASE, {"owner": {"host": "node-7", "pid": 1, "started": 0, "token": "t"}, "heartbeat": time.time() - 600})
    RunLease(storage).acquire().release()


def test_the_heartbeat_refreshes_the_lease(storage):
    lease = RunLease(storage, heartbeat_s=0.2).acquire()
    first = storage.read_json(LEASE)["heartbeat"]
    time.sleep(0.8)
    assert storage.read_json(LEASE)["heartbeat"] > first
    lease.release()


def race(storage: RunStorage, n: int) -> list[str]:
    """`n` starts of the run released by one barrier: each start's owner token, or "refused"."""
    results: list[str] = []
    barrier = threading.Barrier(n)

    def start() -> None:
        lease = RunLease(storage, log=lambda m: None)
        barrier.wait()
        try:
            lease.acquire()
            results.append(str(lease.owner["token"]))
        except RunBusyError:
            results.append("refused")

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_of_starts_in_the_same_instant_exactly_one_wins(storage):
    """Four starts at once: one takes the lease (an exclusive create), the others read its owner
    and refuse; no settling delay decides it."""
    results = race(storage, 4)
    winners = [r for r in results if r != "refused"]
    assert len(winners) == 1 and results.count("refused") == 3, results
    assert storage.read_json(LEASE)["owner"]["token"] == winners[0]


def test_of_takeovers_of_a_stale_lease_in_the_same_instant_exactly_one_wins(storage):
    """Three starts at once find another host's stale lease: one replaces that very version, the
    others' conditional replace fails, they read the winner and refuse."""
    storage.write_json(LEASE, {"owner": {"host": "node-7", "pid": 1, "started": 0, "token": "t"}, "heartbeat": 0})
    results = race(storage, 3)
    winners = [r for r in results if r != "refused"]
    assert len(winners) == 1 and results.count("refused") == 2, results
    assert storage.read_json(LEASE)["owner"]["token"] == winners[0]


def test_a_paused_owner_whose_lease_was_taken_over_stops_before_its_next_commit(storage):
    """The owner (another host's, as far as the lease says) stops beating — paused, or cut off
    from the storage — past the lease's life; a new run takes the run over. When the paused owner
    wakes, its heartbeat finds the other owner, and its next commit raises, naming who runs it now;
    nothing of it is written, and its release leaves the new owner's lease alone."""
    from unirl.stages.runtime.lease import LeaseLostError

    paused = RunLease(storage, heartbeat_s=3600, stale_s=0.5)
    paused.owner["host"] = "node-paused"
    paused.acquire()
    time.sleep(0.7)
    said: list[str] = []
    new = RunLease(storage, log=said.append, stale_s=0.5).acquire()
    assert "taking over the lease" in said[0] and "node-paused" in said[0]
    assert paused.renew() is False  # the paused owner wakes: its heartbeat finds the new owner
    with pytest.raises(LeaseLostError, match=f"is now run by host {socket.gethostname()!r}, pid {os.getpid()}"):
        storage.commit_stage(0, "generate", {"files": []})
    assert not storage.exists(storage.manifest_rel(0, "generate"))
    paused.release()
    assert storage.read_json(LEASE)["owner"]["token"] == new.owner["token"]
    new.release()
    assert not storage.exists(LEASE)


def test_a_heartbeat_that_finds_another_owner_stops_and_does_not_write(storage):
    said: list[str] = []
    lease = RunLease(storage, log=said.append, heartbeat_s=0.1).acquire()
    other_process_lease(storage, host="node-9")  # taken over behind its back
    deadline = time.time() + 10
    while lease.lost_to is None and time.time() < deadline:
        time.sleep(0.05)
    assert lease.lost_to is not None and lease.lost_to["host"] == "node-9"
    assert any("taken over by host 'node-9'" in m for m in said)
    time.sleep(0.3)
    assert storage.read_json(LEASE)["owner"]["token"] == "someone-else"  # its beats stopped: nothing overwritten
    lease.release()
    assert storage.read_json(LEASE)["owner"]["token"] == "someone-else"

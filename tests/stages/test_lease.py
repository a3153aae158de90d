"""One owner per run: a second process refuses naming the owner; a lease whose owner is gone is
taken over, on local disk and on S3 (moto)."""
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


def test_of_two_racing_starts_exactly_one_wins(tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    results: list[str] = []

    def start() -> None:
        try:
            RunLease(storage).acquire()
            results.append("won")
        except RunBusyError:
            results.append("refused")

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused", "won"]

"""Run storage: whole-file commits, manifests written last, resume point, on local and memory://."""
from __future__ import annotations

import os
from typing import Any

import pytest

from unirl.stages.runtime.storage import RunStorage


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        return RunStorage(str(tmp_path / "runs"), "r1")
    root = f"memory://unit-{os.getpid()}-{id(request)}"
    return RunStorage(root, "r1")


def test_write_read_and_no_temp_files_left(storage):
    storage.write_json("a/b.json", {"x": 1})
    assert storage.read_json("a/b.json") == {"x": 1}
    assert storage.listdir("a") == ["b.json"]


def test_stage_commit_requires_listed_files(storage):
    with pytest.raises(FileNotFoundError, match="was not written"):
        storage.commit_stage(0, "score", {"files": ["iter-000000/rewards.arrow"]})
    assert storage.stage_manifest(0, "score") is None
    storage.write_bytes("iter-000000/rewards.arrow", b"x")
    storage.commit_stage(0, "score", {"files": ["iter-000000/rewards.arrow"], "rows": 1})
    assert storage.stage_manifest(0, "score")["rows"] == 1


def test_last_success_needs_contiguous_iterations(storage):
    assert storage.last_success() == -1
    storage.mark_success(0, {})
    storage.mark_success(1, {})
    storage.write_json("iter-000002/manifests/generate.json", {"files": []})
    storage.mark_success(3, {})  # a gap: iteration 2 unfinished
    assert storage.last_success() == 1


def test_checkpoints_count_only_when_committed(storage):
    storage.write_json("checkpoints/000002/extra.json", {})
    storage.write_json("checkpoints/000004/extra.json", {})
    storage.write_json("checkpoints/000004/_COMMITTED", {})
    assert storage.checkpoints() == [4]


def test_local_write_is_atomic_rename(tmp_path):
    s = RunStorage(str(tmp_path), "r")
    s.write_bytes("f.bin", b"1" * 10)
    s.write_bytes("f.bin", b"2" * 5)
    assert (tmp_path / "r" / "f.bin").read_bytes() == b"22222"
    assert sorted(os.listdir(tmp_path / "r")) == ["f.bin"]


def test_bad_run_name():
    with pytest.raises(ValueError, match="not a plain run name"):
        RunStorage("/tmp", "a/b")


# -- object-store errors: retried only when the store is unreachable (issue 34) ---------------------
def client_error(code: str, message: str = "x", status: int | None = None):
    from botocore.exceptions import ClientError

    response: dict[str, Any] = {"Error": {"Code": code, "Message": message}}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "GetObject")


def as_s3fs_raises(error):
    """The exception s3fs raises for a botocore error: translated, the ClientError its cause."""
    from s3fs.errors import translate_boto_error

    try:
        raise translate_boto_error(error) from error
    except OSError as exc:
        return exc


def test_a_missing_path_naming_503_is_not_an_outage():
    from unirl.stages.runtime.storage import transient

    assert not transient(FileNotFoundError("bucket/run/iter-000503/rollouts"))
    assert not transient(FileNotFoundError("bucket/r503/weights/v000503/manifest.json"))
    assert not transient(client_error("NoSuchKey", "iter-000503/_SUCCESS (HTTP 503 in the name)"))
    assert not transient(as_s3fs_raises(client_error("NoSuchKey", "iter-000503/_SUCCESS")))
    assert not transient(client_error("NoSuchBucket", "bucket-503"))
    assert not transient(client_error("404", "Not Found", status=404))
    assert not transient(PermissionError("bucket-503: AccessDenied"))
    assert not transient(as_s3fs_raises(client_error("AccessDenied", "ServiceUnavailable SlowDown 503")))
    assert not transient(ValueError("SlowDown 503 ServiceUnavailable RequestTimeout"))


@pytest.mark.parametrize("code", ["SlowDown", "ServiceUnavailable", "RequestTimeout", "Throttling", "InternalError", "503"])
def test_an_overloaded_store_is_transient_also_as_s3fs_raises_it(code):
    from unirl.stages.runtime.storage import transient

    assert transient(client_error(code))
    assert transient(as_s3fs_raises(client_error(code)))


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_a_5xx_or_429_status_is_transient_whatever_the_code(status):
    from unirl.stages.runtime.storage import transient

    assert transient(client_error("SomethingNew", status=status))
    assert not transient(client_error("SomethingNew", status=400))


def test_connection_and_timeout_errors_are_transient():
    from unirl.stages.runtime.storage import transient

    assert transient(ConnectionRefusedError("127.0.0.1:9000"))
    assert transient(TimeoutError())
    try:
        raise OSError("wrapped") from ConnectionResetError()
    except OSError as exc:
        assert transient(exc)


def test_io_retries_an_outage_with_doubling_waits_and_says_so(monkeypatch, capsys):
    from unirl.stages.runtime import storage as storage_mod

    s = RunStorage(f"memory://retry-{os.getpid()}", "r1")
    sleeps, failures = [], [client_error("SlowDown"), ConnectionRefusedError("store down")]
    monkeypatch.setattr(storage_mod, "_sleep", sleeps.append)

    def flaky():
        if failures:
            raise failures.pop(0)
        return "ok"

    assert s.io("read a", flaky) == "ok"
    assert sleeps == [1, 2]
    err = capsys.readouterr().err
    assert "unreachable (read a: ClientError); retrying in 1s" in err
    assert "unreachable (read a: ConnectionRefusedError); retrying in 2s" in err


def test_io_stops_retrying_at_once_when_the_process_is_interrupted(monkeypatch):
    import threading

    from unirl.stages.runtime import storage as storage_mod

    stopping = threading.Event()
    monkeypatch.setattr(storage_mod, "STOPPING", stopping)
    s = RunStorage(f"memory://stop-{os.getpid()}", "r1")
    calls = []

    def down():
        calls.append(1)
        if len(calls) == 2:
            stopping.set()  # Ctrl-C arrives (storage.interrupt) while the store is down
        raise ConnectionRefusedError("store down")

    with pytest.raises(ConnectionRefusedError):
        s.io("read a", down)
    assert len(calls) == 2  # no attempt after the interrupt, and no wait for the outage to end


def test_io_gives_up_after_retry_s_with_the_original_error(monkeypatch):
    monkeypatch.setenv("UNIRL_STORAGE_RETRY_S", "0")
    s = RunStorage(f"memory://giveup-{os.getpid()}", "r1")
    error = ConnectionRefusedError("store down")

    def down():
        raise error

    with pytest.raises(ConnectionRefusedError) as info:
        s.io("read a", down)
    assert info.value is error


@pytest.fixture(scope="module")
def moto_endpoint():
    from tests.moto_s3 import moto_endpoint

    with moto_endpoint() as url:
        yield url


def test_missing_paths_on_s3_under_names_with_503_fail_at_once(moto_endpoint, monkeypatch):
    import time

    import s3fs

    monkeypatch.setenv("UNIRL_STORAGE_RETRY_S", "30")  # long enough that one wrong retry shows
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint}}
    s3fs.S3FileSystem(**options).mkdir("store-503")
    s = RunStorage("s3://store-503/team", "r503", options)
    missing = RunStorage("s3://no-such-bucket-503/team", "r503", options)
    start = time.monotonic()
    assert not s.exists("iter-000503/_SUCCESS")
    assert s.stage_manifest(503, "score") is None
    with pytest.raises(FileNotFoundError):
        s.read_json("iter-000503/manifests/score.json")
    with pytest.raises(FileNotFoundError):
        s.read_bytes("weights/v000503/manifest.json")
    with pytest.raises(FileNotFoundError):
        missing.read_bytes("iter-000503/_SUCCESS")
    assert time.monotonic() - start < 10

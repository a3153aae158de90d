"""The local Prefect API of a `unirl` command (flows/ephemeral.py): its lean settings, its own socket,
database and log, and its restart."""
from __future__ import annotations

import time

import httpx
import pytest

from unirl.flows.ephemeral import LEAN_SERVER_ENV


def test_the_task_run_recorder_flush_interval_is_a_whole_number_of_seconds():
    """Prefect 3.9's task-run recorder sleeps `int(flush_interval)` seconds between flushes: 0.5
    became `asyncio.sleep(0)` in a loop that kept 1.2 cores busy for the server's whole life (the
    test session's server included; py-spy showed the flush loop)."""
    from prefect.settings.models.server.services import ServerServicesTaskRunRecorderSettings

    value = ServerServicesTaskRunRecorderSettings(
        flush_interval=LEAN_SERVER_ENV["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"]).flush_interval
    assert int(value) == value >= 1


@pytest.mark.slow  # two real Prefect API servers
def test_two_local_apis_keep_apart_and_one_that_dies_comes_back_on_its_address(tmp_path):
    """Two `LocalApi`s at once (two local runs on one machine): each on the socket it bound, with
    the database and log in its own folder; the first migrated database becomes the empty
    template later run folders start from. One server SIGKILLed is started again behind the same
    URL and answers; the other never noticed."""
    from prefect.settings import temporary_settings

    from unirl.flows.ephemeral import LocalApi, template_db

    said: list[str] = []
    apis = [LocalApi(tmp_path / name, log=said.append) for name in ("a", "b")]
    with temporary_settings(updates={"home": tmp_path / "home"}):
        try:
            urls = [api.start() for api in apis]
            assert template_db().parent == tmp_path / "home" and template_db().is_file()
            assert urls[0] != urls[1]
            for name, api in zip(("a", "b"), apis):
                assert (tmp_path / name / "prefect.db").is_file() and api.log_path == tmp_path / name / "server.log"
            kill_and_wait_for_the_restart(apis[0], urls[0], said)
            assert apis[0].restarts == 1 and apis[1].restarts == 0
            assert said == [f"[unirl] Prefect's local API server exited with code -9 (its log: {apis[0].log_path}); "
                            "started again on the same address (1 of 5)"]
            assert httpx.get(f"{urls[1]}/health", timeout=30).status_code == 200
            assert apis[0].log_path.read_text().count("starts the server on " + urls[0]) == 2
        finally:
            for api in apis:
                api.close()
    assert all(api.proc is not None and api.proc.poll() is not None for api in apis)


def kill_and_wait_for_the_restart(api, url: str, said: list[str]) -> None:
    first = api.proc
    first.kill()
    deadline = time.monotonic() + 120
    while api.proc is first or httpx.get(f"{url}/health", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, said
        time.sleep(0.2)

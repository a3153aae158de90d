"""The lean settings unirl gives Prefect's ephemeral API server (flows/ephemeral.py)."""
from __future__ import annotations

from unirl.flows.ephemeral import LEAN_SERVER_ENV


def test_the_task_run_recorder_flush_interval_is_a_whole_number_of_seconds():
    """Prefect 3.9's task-run recorder sleeps `int(flush_interval)` seconds between flushes: 0.5
    became `asyncio.sleep(0)` in a loop that kept 1.2 cores busy for the server's whole life (the
    test session's server included; py-spy showed the flush loop)."""
    from prefect.settings.models.server.services import ServerServicesTaskRunRecorderSettings

    value = ServerServicesTaskRunRecorderSettings(
        flush_interval=LEAN_SERVER_ENV["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"]).flush_interval
    assert int(value) == value >= 1

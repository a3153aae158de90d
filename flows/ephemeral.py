"""Not a speed workaround: without it every SIGKILLed `unirl run` leaves a Prefect API server
behind (tests/flows/test_ephemeral.py).

Prefect's ephemeral API server, tied to the life of the `unirl` process that uses it.

Without `PREFECT_API_URL`, Prefect starts a temporary API server as a subprocess at the first API
call and stops it when the interpreter exits. A `unirl run` killed with SIGKILL (by the OOM
killer, a scheduler, `kill -9`) never exits that way, and the server lives on: its port, its
SQLite database and a couple of hundred MB, one more for every killed run. `tie_ephemeral_api()`
starts the server up front and leaves a watchdog process that stops it once its parent is gone.
The worker group needs no such help: its processes die with their parent (`PR_SET_PDEATHSIG`).

    python flows/ephemeral.py PARENT_PID SERVER_PID     # the watchdog, as tie_ephemeral_api starts it
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

# The ephemeral API serves one local run and stops with it: nobody schedules, automates or reads
# its logs later. Its server keeps only what a run needs and records task runs in batches (one
# transaction per task run made the next iteration's flow-run creation wait behind it).
LEAN_SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "200",
    # A whole number: Prefect 3.9 passes int(flush_interval) to its flush loop, so 0.5 becomes
    # asyncio.sleep(0) in a loop that keeps a core busy for the server's whole life.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "false",
    # Events are kept for the UI's event feed and automations, neither of which outlives a local
    # run; flow and task runs, states and artifacts are recorded without them (what they cost per
    # iteration: benchmarks/README.md, "Orchestration cost per iteration").
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
# Client side: no CSRF token round trip (a loopback server of our own), and no log records sent
# to an API that is gone when the run ends (they are in the run's log file).
LEAN_CLIENT = {"client.csrf_support_enabled": False, "logging.to_api.enabled": False}
# Seconds the ephemeral server may take to come up (Prefect's default, 20, is short for a busy
# 2-core machine where a worker group imports torch beside it).
STARTUP_TIMEOUT_S = 120


def lean_ephemeral_api() -> AbstractContextManager[Any]:
    """Inside the block, a run on Prefect's ephemeral API uses the settings above (a user's own
    server is left as configured). A variable the user set wins."""
    from prefect.settings import get_current_settings, temporary_settings

    from unirl.tasks.common import on_server

    if on_server() or not get_current_settings().server.ephemeral.enabled:
        return nullcontext()
    for key, value in LEAN_SERVER_ENV.items():
        os.environ.setdefault(key, value)
    updates = {**LEAN_CLIENT, "api.ssl_cert_file": str(loopback_ca_file())}
    return temporary_settings(updates={k: v for k, v in updates.items()
                                       if f"PREFECT_{k.upper().replace('.', '_')}" not in os.environ})


def loopback_ca_file() -> Path:
    """A CA file of one certificate for Prefect's client of the ephemeral API. That API is plain
    http on loopback, so no certificate is ever checked, but every Prefect client the run creates
    (one or two per iteration) loads its CA file into an SSL context, and certifi's whole bundle is
    most of a client's start (benchmarks/README.md, "Orchestration cost per iteration")."""
    import certifi

    path = Path(tempfile.gettempdir()) / "unirl-loopback-ca.pem"
    if not path.exists():
        bundle = Path(certifi.where()).read_text()
        begin = bundle.index("-----BEGIN CERTIFICATE-----")
        end = bundle.index("-----END CERTIFICATE-----", begin) + len("-----END CERTIFICATE-----")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(bundle[begin:end] + "\n")
        tmp.replace(path)
    return path


def tie_ephemeral_api() -> None:
    """Start the ephemeral API server now if this process will use one, and its watchdog (on a
    real Prefect server there is nothing to tie)."""
    from prefect.settings import get_current_settings

    from unirl.tasks.common import on_server

    if on_server() or not get_current_settings().server.ephemeral.enabled:
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    # A startup timeout the user set wins.
    server.start(timeout=None if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ else STARTUP_TIMEOUT_S)
    if server.server_process is None:
        return
    subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid()), str(server.server_process.pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C in the terminal is for unirl, which then stops the server itself
    )


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # is_running: not a reused pid
    except psutil.NoSuchProcess:
        return False


def watch(parent_pid: int, server_pid: int, poll_s: float = 0.5, grace_s: float = 10.0) -> None:
    """Return when the server is gone; if the parent goes first, stop the server (SIGTERM, then
    SIGKILL after `grace_s`)."""
    import psutil

    try:
        parent, server = psutil.Process(parent_pid), psutil.Process(server_pid)
    except psutil.NoSuchProcess:
        return
    while _running(server):
        if not _running(parent):
            try:
                server.terminate()
                server.wait(grace_s)
            except psutil.TimeoutExpired:
                server.kill()
            except psutil.NoSuchProcess:
                pass
            return
        time.sleep(poll_s)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))

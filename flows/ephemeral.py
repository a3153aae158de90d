"""Prefect's ephemeral API server, tied to the life of the `unirl` process that uses it.

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
import time


def tie_ephemeral_api() -> None:
    """Start the ephemeral API server now if this process will use one, and its watchdog (on a
    real Prefect server there is nothing to tie)."""
    from prefect.settings import get_current_settings

    from tasks.common import on_server

    if on_server() or not get_current_settings().server.ephemeral.enabled:
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
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

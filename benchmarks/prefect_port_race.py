"""Why a local run could lose its Prefect API mid-way: two runs that start Prefect's own temporary
API server (`SubprocessASGIServer`, what unirl used before flows/ephemeral.py) on the same port.
Each draws a random port in 8000-8999, checks that it is free and starts uvicorn, which binds only
after its start-up (migrations, seconds); meanwhile each polls `/health` on its port. The loser's
uvicorn fails to bind (exit code 3), but its health check was already answered by the winner's
server, so it uses that one until the winner's run ends and stops it.

    python benchmarks/prefect_port_race.py      # two processes forced onto one port (a 1-in-1000 draw)

Prints, per process, the API it believes is its own and its own uvicorn's exit code.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

PORT = 8613


def child(home: str, hold_s: float) -> None:
    os.environ.update(PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer._port_range = range(PORT, PORT + 1)  # both drew the same port
    server = SubprocessASGIServer()
    server.start(timeout=120)
    time.sleep(3)
    assert server.server_process is not None
    print(f"pid {os.getpid()}: believes its API is {server.api_url}; its own uvicorn (pid {server.server_process.pid}) "
          f"exit code {server.server_process.poll()}", flush=True)
    time.sleep(hold_s)
    server.stop()


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], float(sys.argv[3]))
        return 0
    home = tempfile.mkdtemp(prefix="unirl-port-race-")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", home, hold], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for hold in ("5", "10")]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        print(out.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

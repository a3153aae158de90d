"""One real Prefect server for the whole test session (`prefect server start`, SQLite in a temp
dir, on loopback): every `unirl run` of the suite reports to it through PREFECT_API_URL instead
of starting Prefect's ephemeral API server itself (about 10 s a run on 2 cores), and the
deployment tests add their work pool and worker to it. tests/conftest.py starts it on first use."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from unirl.flows.ephemeral import LEAN_SERVER_ENV, loopback_ca_file

PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    """A Prefect server and what tests start beside it (workers), all in one temp dir. `env` is
    the environment a client of this server needs."""

    def __init__(self, tmp: Path, env: dict[str, str], repo: Path):
        self.tmp, self.repo = tmp, repo
        self.url = f"http://127.0.0.1:{free_port()}/api"
        self.env = {**env, **{
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp / 'prefect.db'}",
            "PREFECT_SERVER_UI_ENABLED": "false",
            # From unirl's own lean ephemeral API (flows/ephemeral.py): task runs recorded in batches
            # (one transaction each makes every iteration's next flow run wait behind them), and the
            # services no test reads off: the event feed's store (automations' triggers read the
            # event stream, not the store), late-run marking, pause expiry, the scheduler (the one
            # scheduled deployment ships paused), foreman, vacuum. The two servers of a session
            # spent 272 CPU-s of the suite's 1873 with the first four on; a tiny 6-iteration run
            # cost its server 4.5 CPU-s, 3.2 without. Triggers, the repossessor and cancellation
            # clean-up stay: the deployment tests' event-started and cancelled runs need them.
            **{k: v for k, v in LEAN_SERVER_ENV.items() if any(part in k for part in (
                "TASK_RUN_RECORDER", "ANALYTICS", "EVENT_PERSISTER", "LATE_RUNS", "PAUSE_EXPIRATIONS", "SCHEDULER",
                "FOREMAN", "DB_VACUUM"))},
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false",  # our own loopback server has CSRF protection off
            # plain http on loopback: a client need not load certifi's whole bundle (as unirl's own
            # ephemeral API, flows/ephemeral.py)
            "PREFECT_API_SSL_CERT_FILE": str(loopback_ca_file()),
            "PREFECT_CLI_COLORS": "false",
            "COLUMNS": "200",
            "DO_NOT_TRACK": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
        }}
        self.procs: list[subprocess.Popen] = []
        # What a `unirl` process needs to report here: the URL, and the one-certificate CA file (a
        # client of plain http on loopback need not load certifi's whole bundle: ~0.2 s a process)
        self.client_env = {k: self.env[k] for k in ("PREFECT_API_URL", "PREFECT_API_SSL_CERT_FILE")}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`prefect <args>` in the background, its output in `<tmp>/<name>.log`."""
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([*PREFECT, *args], env=env or self.env, cwd=self.repo, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def serve(self, timeout: float = 180) -> PrefectServer:
        port = self.url.split(":")[-1].split("/")[0]
        self.server = self.start("server", "server", "start", "--host", "127.0.0.1", "--port", port)
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.server.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"prefect server did not come up:\n{self.log('server')}")

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def cli(self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*PREFECT, *args], env=env or self.env, cwd=self.repo, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)[:300]} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                f"stderr:\n{proc.stderr[-4000:]}\nworker log:\n{self.log('worker')}"
            )
        return proc

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.url)

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGINT, then SIGKILL to its whole process group (a worker takes its flow runs along).
        A process worker takes about 10 s to leave its polling loop after SIGINT; nothing the tests
        read depends on a graceful exit, so it gets 2 s."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):  # workers before the server
            self.stop(proc)

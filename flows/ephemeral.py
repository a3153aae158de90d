"""Prefect's API for one local `unirl` command: a server of the run's own, that dies with it and
is started again when it dies first.

Without `PREFECT_API_URL`, Prefect would start its temporary API server (`SubprocessASGIServer`)
at the first API call. Three things went wrong with it (docs/deploy.md, "The local Prefect API"):
* every local run on a machine shared one SQLite file (`~/.prefect/prefect.db`);
* it chooses a random port, checks that it is free and starts uvicorn, which binds only after its
  start-up (migrations, seconds): two runs starting together can take the same port, and the
  loser's health check is answered by the winner's server, which it then uses until the winner's
  run ends and takes it down (`Connection refused` mid-run);
* a server that died took the run down with it, and its stderr went to the run's terminal.

`LocalApi` binds the listening socket itself (port 0: the kernel's choice, no race) and hands it to
uvicorn (`--fd`), with a database of the run's own and its log in the run folder. The socket
stays open in `unirl` for the run's whole life, so a server that dies is started again behind the
same address: requests made meanwhile wait in the socket's backlog instead of being refused. The
server dies with `unirl` (PR_SET_PDEATHSIG), a SIGKILLed run included.
"""
from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from unirl.stages.runtime.processes import die_with_parent
from unirl.stages.runtime.scratch import log_tail

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


# Set in `unirl`'s environment to its local API's URL while it serves: `on_server()` (tasks/common.py)
# tells that API from a Prefect server the user runs.
LOCAL_API_ENV = "UNIRL_LOCAL_PREFECT_API"
# How often a local API server that died is started again before the run is let fail.
RESTARTS = 5


def wanted() -> bool:
    """Whether this process should serve its own API: no Prefect server configured
    (`PREFECT_API_URL`), and Prefect's ephemeral mode not switched off."""
    from prefect.settings import get_current_settings  # start-up time: prefect loads on first use, not when a recipe is read

    settings = get_current_settings()
    return settings.api.url is None and settings.server.ephemeral.enabled


@contextmanager
def local_api(folder: Callable[[], Path], log: Callable[[str], None] = print) -> Iterator[LocalApi | None]:
    """Inside the block, Prefect reports to a `LocalApi` whose database and log are in `folder()`,
    asked only when one is started (None where a Prefect server is configured: the user's server is left as it is), with the lean
    settings above; a variable the user set wins."""
    from prefect.settings import temporary_settings  # start-up time: prefect loads on first use, not when a recipe is read

    if not wanted():
        yield None
        return
    for key, value in LEAN_SERVER_ENV.items():
        os.environ.setdefault(key, value)
    api = LocalApi(folder(), log=log)
    url = api.start()
    updates: dict[str, Any] = {**LEAN_CLIENT, "api.ssl_cert_file": str(loopback_ca_file())}
    updates = {k: v for k, v in updates.items() if f"PREFECT_{k.upper().replace('.', '_')}" not in os.environ}
    os.environ[LOCAL_API_ENV] = url
    try:
        with temporary_settings(updates={**updates, "api.url": url}):
            yield api
    finally:
        os.environ.pop(LOCAL_API_ENV, None)
        api.close()


class LocalApiDown(RuntimeError):
    """The local API server could not be started, or kept dying."""


class LocalApi:
    """A Prefect API server for this process (module docstring): `folder/prefect.db`, its output
    appended to `folder/server.log`; `start()` returns its URL, which stays the same across
    restarts. `restarts`: how often it was started again after dying."""

    def __init__(self, folder: Path, *, log: Callable[[str], None] = print, restarts: int = RESTARTS):
        self.folder, self.say, self.max_restarts = Path(folder), log, restarts
        self.db, self.log_path = self.folder / "prefect.db", self.folder / "server.log"
        self.sock: socket.socket | None = None
        self.template = self.db  # the empty database new run folders start from (start() sets it)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.gave_up = False
        self._closing = threading.Event()
        self._started = threading.Event()
        self._watcher: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        assert self.sock is not None, "start() first"
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/api"

    def start(self) -> str:
        """Bind the socket, start the server and wait until it answers; its URL."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.template = template_db()  # read here: the watcher thread does not see this thread's settings
        if not self.db.exists() and self.template.exists():
            copy_db(self.template, self.db)  # a migrated empty database: no migrations at the first start
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        # One thread starts the server and starts it again, and lives as long as the API:
        # PR_SET_PDEATHSIG fires when the thread that forked a child ends, not its process.
        self._watcher = threading.Thread(target=self._serve, name="unirl-local-api", daemon=True)
        self._watcher.start()
        self._started.wait()
        if self._error is not None:
            self.close()
            raise self._error
        return self.url

    def _launch(self) -> subprocess.Popen:
        assert self.sock is not None
        env = {**os.environ, "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT_UI_ENABLED": "0",
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.db}"}
        env.pop("PREFECT_API_URL", None)
        fd = self.sock.fileno()
        with open(self.log_path, "a") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} unirl (pid {os.getpid()}) starts the server on {self.url}\n")
            out.flush()
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--fd", str(fd), "--factory", "prefect.server.api.server:create_app",
                 "--lifespan", "on", "--log-level", "warning"],
                pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent, start_new_session=True,  # Ctrl-C is for unirl, which then stops it
            )

    def _wait_healthy(self, proc: subprocess.Popen) -> None:
        import httpx  # start-up time: httpx loads on first use, not when a recipe is read

        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", STARTUP_TIMEOUT_S))
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while True:
                if proc.poll() is not None:
                    raise LocalApiDown(f"Prefect's local API server exited with code {proc.returncode} while starting "
                                       f"(its log: {self.log_path}):\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise LocalApiDown(f"Prefect's local API server did not answer within {timeout:.0f} s (its log: "
                                       f"{self.log_path}; PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS allows longer)")
                time.sleep(0.1)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines, missing="")

    def _serve(self) -> None:
        """The watcher thread: start the server, then start it again each time it dies on its own."""
        try:
            self.proc = self._launch()
            self._wait_healthy(self.proc)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            self._error = exc
            self._started.set()
            return
        self._started.set()
        if not self.template.exists():
            copy_db(self.db, self.template)
        while not self._closing.wait(0.5):
            code = self.proc.poll()
            if code is None:
                continue
            if self.restarts >= self.max_restarts:
                self.gave_up = True
                if self.sock is not None:
                    self.sock.close()  # requests are refused now, not left waiting in the backlog
                self.say(f"[unirl] Prefect's local API server died again (exit code {code}) after {self.restarts} "
                         f"restarts; the run stops here (server log: {self.log_path})")
                return
            self.restarts += 1
            self.say(f"[unirl] Prefect's local API server exited with code {code} (its log: {self.log_path}); "
                     f"started again on the same address ({self.restarts} of {self.max_restarts})")
            try:
                self.proc = self._launch()
                self._wait_healthy(self.proc)
            except LocalApiDown as exc:
                self.say(f"[unirl] {exc}")

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and close the socket."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()


def template_db() -> Path:
    """A Prefect database migrated to this Prefect's schema and holding nothing else, copied into
    each new run folder: a fresh database's migrations took a local API's first start from 7-9 s
    to 19-20 s (2 loaded cores). In Prefect's home, by Prefect version."""
    import prefect  # start-up time: prefect loads on first use, not when a recipe is read
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / f"unirl-empty-{prefect.__version__}.db"


def copy_db(src: Path, dst: Path) -> None:
    """A consistent copy of SQLite database `src` (live or not) at `dst`, written whole or not at all;
    a copy that fails leaves nothing behind (the server then migrates a database of its own)."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(src) as a, sqlite3.connect(tmp) as b:
            a.backup(b)
        a.close()
        b.close()
        tmp.replace(dst)
    except (OSError, sqlite3.Error):
        tmp.unlink(missing_ok=True)


def loopback_ca_file() -> Path:
    """A CA file of one certificate for Prefect's client of the ephemeral API. That API is plain
    http on loopback, so no certificate is ever checked, but every Prefect client the run creates
    (one or two per iteration) loads its CA file into an SSL context, and certifi's whole bundle is
    most of a client's start (benchmarks/README.md, "Orchestration cost per iteration")."""
    import certifi  # start-up time: certifi loads on first use, not when a recipe is read

    path = Path(tempfile.gettempdir()) / "unirl-loopback-ca.pem"
    if not path.exists():
        bundle = Path(certifi.where()).read_text()
        begin = bundle.index("-----BEGIN CERTIFICATE-----")
        end = bundle.index("-----END CERTIFICATE-----", begin) + len("-----END CERTIFICATE-----")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(bundle[begin:end] + "\n")
        tmp.replace(path)
    return path



"""The suite's fork server (tests/forkserver.py): one warm interpreter per pytest worker
that the suite's `python -m unirl.flows.cli ...` commands, and through unirl's launch hook (UNIRL_LAUNCHER) their worker
ranks, torchrun agents, rollout engines and producers, are forked from instead of started cold.

A tiny `unirl run` spends about half of its flow process's CPU, and a worker rank nearly all of its
~5 CPU-s, importing torch, transformers, diffusers, peft, pyarrow, MLflow and SQLAlchemy
(benchmarks/README.md, "Start-up"), and the suite starts a few hundred of them. The server imports
those once, with Prefect (not `prefect.main`, which configures logging: each child does that under
its own environment) and every module of `unirl.stages`, and forks one child per command. Prefect
reads its settings from the environment when it is imported, so each child reads them again under
its command's environment (`refresh_global_settings_context`, tests/forkserver.py `run_child`); no
`unirl.stages` module reads the environment at import (tests/test_zygote.py checks that) but
through the registries, which load the plugins UNIRL_PLUGINS names (a child naming others loads
them again: forkserver.load_plugins_again), and the recipe-field tracer (UNIRL_FIELD_TRACE, which a
forked command must share with the server); `unirl.flows` is imported by each child. A forked tiny
2-iteration `unirl run` took 6.8 CPU-s with third-party modules only preloaded, 5.9 with
`unirl.stages` too, 4.9 with Prefect too. From the test's side a forked command is a process like
any other: a pid to signal, an exit status (`-9` when SIGKILLed), its output, its command line in
`ps`. The one setting a preloaded library reads at import is MLflow's log level, which `unirl` sets
before it imports MLflow (tasks/console.py `QUIET_ENV`): the server is started with that value, and
a command that would run with another (`--verbose`, its own MLFLOW_LOGGING_LEVEL) starts fresh, as
do commands of other modules (`popen` falls back to `subprocess.Popen`).

Where a test needs the processes of a run to be its flow process's children (the Prefect worker's
runs in tests/e2e/test_deployment.py), its environment has no UNIRL_LAUNCHER and they start fresh.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests import forkserver

MODULES = ("unirl.flows.cli", "unirl.flows.deploy")  # `python -m` commands a test forks (the rest fork through the launch hook)


def import_env() -> dict[str, str]:
    """The settings the preloaded libraries read at import, as `unirl` sets them before it imports
    them (tasks/console.py `QUIET_ENV`), and the suite's recipe-field tracer, which is set up when
    `unirl.stages` is imported (tests/conftest.py sets UNIRL_FIELD_TRACE for the session)."""
    from unirl.tasks.console import QUIET_ENV

    env = {k: QUIET_ENV[k] for k in ("MLFLOW_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    if "UNIRL_FIELD_TRACE" in os.environ:
        env["UNIRL_FIELD_TRACE"] = os.environ["UNIRL_FIELD_TRACE"]
    return env


PRELOAD = (
    "torch", "numpy", "pyarrow", "pyarrow.compute", "pyarrow.ipc", "safetensors.torch", "PIL.Image", "yaml", "pydantic",
    "httpx", "anyio", "rich.console", "sqlalchemy", "fastapi", "uvicorn", "mlflow", "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store", "aiohttp", "botocore.session", "cryptography.fernet", "griffe", "websockets",
    "jsonschema", "coolname",
    # Prefect itself (its flows, tasks and client, not `prefect.main`, which configures logging):
    # the settings it reads at import are read again in each child (forkserver.run_child)
    "prefect",
    # a worker rank's and a torchrun agent's
    "torch.distributed", "torch.distributed.run", "torch.distributed.device_mesh", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.tensor", "transformers", "diffusers", "peft",
)


def preload() -> list[str]:
    """PRELOAD, what every model family's worker rank imports (`Family.modules`), and every module
    of `unirl.stages` (none reads the environment when it is imported: tests/test_zygote.py checks)."""
    from unirl.stages.runtime.registry import families

    names = list(PRELOAD)
    for kind in families.names():
        names += [m for m in families.get(kind).modules if m not in names]
    return names + stages_modules()


def stages_modules() -> list[str]:
    """Every module of the `unirl.stages` package but its entry points (`__main__`)."""
    import pkgutil

    import unirl.stages

    return [m.name for m in pkgutil.walk_packages(unirl.stages.__path__, "unirl.stages.") if not m.name.endswith("__main__")]


class Zygote:
    def __init__(self) -> None:
        from tests.conftest import REPO, isolated_env

        self.folder = Path(tempfile.mkdtemp(prefix="unirl-zygote-"))
        self.path = str(self.folder / "socket")
        self.proc = forkserver.start(self.path, preload(), {**isolated_env(self.folder, forked=False), **import_env()}, str(REPO))

    def stop(self) -> None:
        import shutil

        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def popen(self, cmd: list[str], **kwargs: Any) -> Any:
        """`subprocess.Popen([sys.executable, "-m", MODULE, ...], ...)`, forked (what `forks`
        allows: the server does not compare its import-time settings with a test's command)."""
        proc = forkserver.popen(self.path, cmd, modules=None, strict=False, **kwargs)
        if proc is None:
            raise RuntimeError(f"no fork server at {self.path} for {cmd}")
        return proc

    def run(self, cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None, timeout: float | None = None,
            stdin: Any = None, stdout: Any = None, stderr: Any = None, capture_output: bool = False,
            text: bool = False) -> subprocess.CompletedProcess:
        """`subprocess.run` of a forked command; output is captured through files (no pipe to drain)."""
        if not capture_output:
            proc = self.popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
            return subprocess.CompletedProcess(cmd, _wait(proc, timeout))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = self.popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err)
            code = _wait(proc, timeout)
            texts = []
            for f in (out, err):
                f.seek(0)
                data = f.read()
                texts.append(data.decode("utf-8", errors="replace") if text else data)
        return subprocess.CompletedProcess(cmd, code, *texts)


def _wait(proc: Any, timeout: float | None) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


_SERVER: Zygote | None = None


def forks(cmd: list[str], env: dict[str, str] | None) -> bool:
    """`cmd` runs as it would in a fresh interpreter when forked from the server."""
    if not (len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in MODULES) or "--verbose" in cmd:
        return False
    environ = os.environ if env is None else env
    return all(environ.get(key, value) == value for key, value in import_env().items())


def server() -> Zygote:
    """This process's zygote server, started on first use."""
    global _SERVER
    if _SERVER is None:
        import atexit

        _SERVER = Zygote()
        atexit.register(_SERVER.stop)
    return _SERVER


def popen(cmd: list[str], **kwargs: Any) -> Any:
    """`subprocess.Popen`, forked from the warm server where `cmd` is a forked command."""
    return server().popen(cmd, **kwargs) if forks(cmd, kwargs.get("env")) else subprocess.Popen(cmd, **kwargs)


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run`, forked from the warm server where `cmd` is a forked command."""
    return server().run(cmd, **kwargs) if forks(cmd, kwargs.get("env")) else subprocess.run(cmd, **kwargs)

"""A warm interpreter the suite forks `python -m flows.cli ...` processes from, instead of starting
each one cold.

A tiny `unirl run` spends about half of its flow process's CPU importing torch, pyarrow, MLflow,
SQLAlchemy and pydantic (benchmarks/README.md, "Start-up"), and the suite starts about a hundred
of them. This server (one per pytest worker, started on first use) imports those libraries once
and then forks one child per command: the child takes the command's stdin/stdout/stderr, working
directory and environment and runs the module as `__main__`, as `python -m` does, then exits
through the interpreter's normal shutdown (atexit handlers, non-daemon threads joined). From the
test's side it is a process like any other: a pid to signal, an exit status (`-9` when
SIGKILLed), its output.

What is preloaded is third-party only: not Prefect (its settings are read from the environment
when it is imported) and none of unirl's own modules, so the child imports those under the test's
environment exactly as a fresh interpreter would. The one setting a preloaded library reads at
import is MLflow's log level, which `unirl` sets before it imports MLflow (flows/console.py
`QUIET_ENV`): the server is started with that value, and a command that would run with another
(`--verbose`, its own MLFLOW_LOGGING_LEVEL) starts fresh, as do `python -m` commands of other
modules and every other command (`popen` falls back to `subprocess.Popen`). The children a forked
process starts itself (worker ranks, torchrun, engines) are fresh interpreters, as for a user.

    python tests/zygote.py SOCKET      # the server (what `Zygote` starts)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODULES = ("flows.cli",)  # `python -m` commands that are forked


def import_env() -> dict[str, str]:
    """The settings the preloaded libraries read at import, as `unirl` sets them."""
    from flows.console import QUIET_ENV

    return {"MLFLOW_LOGGING_LEVEL": QUIET_ENV["MLFLOW_LOGGING_LEVEL"], "MLFLOW_CONFIGURE_LOGGING": "true"}


PRELOAD = (
    "torch", "numpy", "pyarrow", "pyarrow.compute", "pyarrow.ipc", "safetensors.torch", "PIL.Image", "yaml", "pydantic",
    "httpx", "anyio", "rich.console", "sqlalchemy", "fastapi", "uvicorn", "mlflow", "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store", "aiohttp", "botocore.session", "cryptography.fernet", "griffe", "websockets",
    "jsonschema", "coolname",
)


# -- the server ---------------------------------------------------------------------------------------


def serve(path: str) -> dict[str, Any] | None:
    """Accept commands until stdin closes (the test process went away). Returns, in a forked child
    only, the command it is to run."""
    import gc
    import importlib
    import selectors
    import threading

    gc.disable()
    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a fork keeps only the forking thread: no other may exist
        raise RuntimeError(f"a preloaded module started a thread: {threading.enumerate()}")
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                return None
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            command = json.loads(message)
            pid = os.fork()  # from the only thread there is
            if pid == 0:
                sel.close()
                listener.close()
                conn.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in set(fds):
                    os.close(fd)
                return command
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test stopped listening
                conn.close()


def run_child(command: dict[str, Any]) -> int:
    """In the forked child: become `python -m MODULE ARGS...` in the command's folder and
    environment."""
    import gc
    import runpy
    import traceback

    import numpy as np

    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    sys.path[0] = command["cwd"]  # `python -m` puts the working directory first
    sys.argv = [command["module"], *command["args"]]
    np.random.seed()  # a fresh interpreter's generator differs from process to process (`random` reseeds itself on fork)
    gc.enable()
    try:
        runpy.run_module(command["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1
    return 0


# -- the test side ------------------------------------------------------------------------------------


class Forked:
    """A forked command, with the `subprocess.Popen` surface the suite uses."""

    def __init__(self, conn: socket.socket, args: list[str], stdout: Any, stderr: Any):
        self._conn, self.args, self.stdout, self.stderr = conn, args, stdout, stderr
        self._buffer = b""
        self.returncode: int | None = None
        self.pid = int(self._line(None).removeprefix("pid "))

    def _line(self, timeout: float | None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except (socket.timeout, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the zygote server went away while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(timeout).removeprefix("exit "))
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        out = self.stdout.read() if self.stdout is not None else None
        err = self.stderr.read() if self.stderr is not None else None
        self.wait(timeout)
        return out, err


class Zygote:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="unirl-zygote-"))
        self.path = str(self.folder / "socket")
        from tests.conftest import isolated_env

        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**isolated_env(self.folder), **import_env()}, cwd=str(self.folder))
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the zygote server did not start (exit {self.proc.wait()})")

    def stop(self) -> None:
        import shutil

        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def popen(self, cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
              stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False) -> Forked:
        """`subprocess.Popen([sys.executable, "-m", "flows.cli", ...], ...)`, forked."""
        opened: list[int] = []

        def fd(spec: Any, default: int, mode: str) -> tuple[int, Any]:
            if spec is None:
                return default, None
            if spec == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_RDWR))
                return opened[-1], None
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                opened.append(write if mode == "r" else read)
                mine = read if mode == "r" else write
                return opened[-1], open(mine, mode if text else mode + "b", encoding="utf-8" if text else None)
            if isinstance(spec, int):
                return spec, None
            return spec.fileno(), None

        in_fd, _ = fd(stdin, 0, "w")
        out_fd, out = fd(stdout, 1, "r")
        err_fd, err = (out_fd, None) if stderr == subprocess.STDOUT else fd(stderr, 2, "r")
        command = {"module": cmd[2], "args": list(cmd[3:]), "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(command).encode()], [in_fd, out_fd, err_fd])
            return Forked(conn, cmd, out, err)
        finally:
            for fd_ in opened:
                os.close(fd_)

    def run(self, cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None, timeout: float | None = None,
            stdout: Any = None, stderr: Any = None, capture_output: bool = False, text: bool = False) -> subprocess.CompletedProcess:
        """`subprocess.run` of a forked command; output is captured through files (no pipe to drain)."""
        if not capture_output:
            proc = self.popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
            return subprocess.CompletedProcess(cmd, _wait(proc, timeout))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = self.popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
            code = _wait(proc, timeout)
            texts = []
            for f in (out, err):
                f.seek(0)
                data = f.read()
                texts.append(data.decode("utf-8", errors="replace") if text else data)
        return subprocess.CompletedProcess(cmd, code, *texts)


def _wait(proc: Forked, timeout: float | None) -> int:
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
    env = os.environ if env is None else env
    return all(env.get(key, value).lower() == value.lower() for key, value in import_env().items())


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


if __name__ == "__main__":
    job = serve(sys.argv[1])
    if job is not None:
        sys.exit(run_child(job))

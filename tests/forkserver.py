"""The test suite's fork server: a warm interpreter that forks unirl's processes instead of
starting each one fresh. Test machinery only: unirl reaches it through its one launch hook
(`UNIRL_LAUNCHER`, unirl.stages.runtime.processes `launcher`), which the suite points at this file.

A worker rank spends about 5 CPU-s importing torch, transformers, diffusers, peft and
torch.distributed.checkpoint before it does anything (benchmarks/README.md, "Start-up"), and the
suite starts a few hundred processes. With `UNIRL_LAUNCHER` set to this file and `UNIRL_FORKSERVER`
to a server's socket, unirl's `spawn` asks the server (`launch`) to fork the `python -m MODULE ...`
commands in `FORKABLE` (worker ranks, rollout engines, the async producer, torchrun's ranks through
`python tests/forkserver.py --exec SOCKET python -m MODULE ...`, `rank_entry`) and gets back a
handle with `subprocess.Popen`'s surface. A command the server cannot run as a fresh interpreter
would (a setting its preloaded libraries read at import differs) or a server that cannot be
reached starts fresh, as without it.

What the forked child keeps from a fresh start:
* the command's stdin/stdout/stderr (passed over the socket), working directory, environment and
  argv; the module runs as `__main__`, as `python -m` runs it, and ends as the interpreter ends a
  program in every step a program can see (non-daemon threads joined, atexit handlers, streams
  flushed), without tearing down the modules it inherited (`leave`);
* a new session when asked (`start_new_session`), so the caller can signal its process group;
* it dies with the process that asked for it (a pidfd watched by a thread: the server is its
  parent, so PR_SET_PDEATHSIG alone would tie it to the server);
* its command line in /proc reads as the command's (written over the server's padded argv), so
  `ps` and `unirl.flows.hooks.worker_processes` see `python -m unirl.stages.workers --spec ...`;
* its exit status reads as Popen's (`-9` after SIGKILL);
* its parent as unirl asks for it (`parent_pid`): the process that asked, not the server.
What is preloaded is listed by its owner (tests/zygote.py `preload`): third-party modules,
Prefect and `unirl.stages`. Prefect reads its settings from the environment when imported, so a
child reads them again under its command's environment before it runs; `unirl.flows` is imported
by the child.

    python tests/forkserver.py SOCKET [--preload m1,m2] [--pad N]   # the server
    python tests/forkserver.py --exec SOCKET python -m MODULE ...   # one command, forked by it
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

# `python -m` commands a server forks.
FORKABLE = ("unirl.flows.cli", "unirl.stages.workers", "unirl.stages.engine_server", "unirl.flows.producer", "torch.distributed.run")
# Read by a preloaded library at import: a command must run with the server's value, or start fresh.
IMPORT_ENV = ("MLFLOW_LOGGING_LEVEL", "MLFLOW_CONFIGURE_LOGGING", "TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE",
              "HF_HOME", "TORCH_LOGS", "UNIRL_FIELD_TRACE")  # the last: the recipe-field tracer, set up when unirl.stages is imported
PAD = 4096  # bytes of argv the server keeps for its children's command lines
PARENT: int | None = None  # in a forked child: the pid of the process that would have been its parent
SOCKET_ENV = "UNIRL_FORKSERVER"  # the server's socket, beside UNIRL_LAUNCHER=<this file>
HOOK = "unirl_launcher"  # the module name unirl loads its launch hook under (processes.launcher)


def env(socket_path: str) -> dict[str, str]:
    """The environment that makes unirl's processes fork from the server at `socket_path`."""
    return {"UNIRL_LAUNCHER": os.path.abspath(__file__), SOCKET_ENV: socket_path}


# -- the launch hook (unirl.stages.runtime.processes `launcher`) --------------------------------------


def parent_pid() -> int:
    """This process's parent as its command sees it: for a forked child, the process that asked
    for it (a proxy's parent, for a rank torchrun started through `proxy`), not the server."""
    return PARENT if PARENT is not None else os.getppid()


def launch(cmd: list[str], **kwargs: Any) -> Forked | None:
    """unirl's `spawn`: `cmd` forked by the server in UNIRL_FORKSERVER, dying with this process;
    None (start it fresh) when it cannot be."""
    server = os.environ.get(SOCKET_ENV)
    return popen(server, cmd, watch=True, **kwargs) if server else None


def rank_entry(args: list[str]) -> list[str]:
    """What `torchrun` runs as each rank: this file's proxy (`proxy`) for a rank forked from the
    server in UNIRL_FORKSERVER."""
    server = os.environ.get(SOCKET_ENV)
    if not server:
        return ["-m", "unirl.stages.workers", *args]
    return [os.path.abspath(__file__), "--exec", server, sys.executable, "-m", "unirl.stages.workers", *args]


# -- the server ---------------------------------------------------------------------------------------


def serve(path: str, preload: list[str]) -> dict[str, Any] | None:
    """Accept commands until stdin closes (the owner went away). Returns, in a forked child only,
    the command it is to run."""
    import gc
    import importlib
    import selectors

    gc.disable()
    for module in preload:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a fork keeps only the forking thread: no other may exist
        raise RuntimeError(f"a preloaded module started a thread: {threading.enumerate()}")
    gc.freeze()
    import_env = {key: os.environ.get(key) for key in IMPORT_ENV}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:
                return None
            if key.data is not None:  # a child's pidfd: it exited; its caller hears at once
                pid = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                conn = children.pop(pid)
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the caller stopped listening
                conn.close()
                continue
            conn, _ = listener.accept()
            fds: list[int] = []
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                command = json.loads(message)
            except (OSError, ValueError):  # a caller that went away mid-request: the server stays
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            differs = [k for k, v in import_env.items() if command["env"].get(k) != v] if command["strict"] else []
            if differs:
                conn.sendall(f"refused {','.join(differs)}\n".encode())
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            caller = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
            pid = os.fork()  # from the only thread there is
            if pid == 0:
                for fileobj in list(sel.get_map().values()):
                    if isinstance(fileobj.fileobj, int):
                        os.close(fileobj.fileobj)
                sel.close()
                listener.close()
                conn.close()
                for c in children.values():
                    c.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in set(fds):
                    if fd > 2:
                        os.close(fd)
                return {**command, "caller": caller}
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
            sel.register(os.pidfd_open(pid), selectors.EVENT_READ, data=pid)


def run_child(command: dict[str, Any]) -> int:
    """In the forked child: become `python -m MODULE ARGS...` in the command's folder and
    environment."""
    import gc
    import runpy
    import traceback

    if command.get("new_session"):
        os.setsid()
    global PARENT
    PARENT = command.get("parent") or command["caller"]
    if command.get("watch"):
        die_with(command["caller"])
    set_cmdline([sys.executable, "-m", command["module"], *command["args"]])
    os.chdir(command["cwd"])
    plugins = os.environ.get("UNIRL_PLUGINS")
    os.environ.clear()
    os.environ.update(command["env"])
    sys.path[0] = command["cwd"]  # `python -m` puts the working directory first
    sys.argv = [command["module"], *command["args"]]
    if os.environ.get("UNIRL_PLUGINS") != plugins:
        load_plugins_again(command)
    if command["module"].startswith("unirl.flows.") and "prefect.context" in sys.modules:
        # Prefect's settings as its import reads them, under this environment (0.09 CPU-s; the
        # other commands, ranks and engines, never use Prefect)
        sys.modules["prefect.context"].refresh_global_settings_context()
    if "numpy" in sys.modules:  # a fresh interpreter's global generator differs from process to process
        sys.modules["numpy"].random.seed()  # (`random` reseeds itself after a fork)
    gc.enable()
    code = 0
    try:
        runpy.run_module(command["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if isinstance(exit.code, int):
            code = exit.code
        elif exit.code is not None:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    return code


def load_plugins_again(command: dict[str, Any]) -> None:
    """The command names other plugins (UNIRL_PLUGINS) than the server, whose preloaded registries
    loaded its own: import them as a fresh process would when its registries load. A plugin that
    adds a model family, source, policy, engine, algorithm or kernel would be missing from the
    unions the preloaded `Recipe` was built with (the suite's add tools, looked up by name), so
    then the command runs as a fresh interpreter in this process instead."""
    registry = sys.modules.get("unirl.stages.runtime.registry")
    if registry is None:
        return
    registries = [v for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("unirl.")
                  for v in vars(m).values() if isinstance(v, registry.Registry) and v.what != "tool"]
    before = [r.names() for r in registries]
    vars(registry)["_PLUGINS_LOADED"] = False
    registry.load_plugins()
    if [r.names() for r in registries] != before:
        os.execv(sys.executable, [sys.executable, "-m", command["module"], *command["args"]])


def leave(code: int) -> None:
    """End a forked child as the interpreter ends a program, in the steps a program can see:
    non-daemon threads joined, atexit handlers run (logging's flush among them), the standard
    streams flushed; then exit without tearing down the modules it inherited from the server,
    whose every touched page would be copied first (about half a second of CPU a process)."""
    import atexit

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


def die_with(pid: int) -> None:
    """SIGKILL this process when process `pid` ends (as PR_SET_PDEATHSIG does for a parent)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="unirl-die-with-caller", daemon=True).start()


def set_cmdline(args: list[str]) -> None:
    """Write `args` over this process's argv, so /proc/PID/cmdline shows them (cut to the server's
    padded argv; the rest NUL)."""
    import ctypes

    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    size = end - start
    data = b"\0".join(a.encode() for a in args)[: size - 1]
    ctypes.memmove(start, data + b"\0" * (size - len(data)), size)


def start(path: str, preload: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
    """Launch a server on `path` with `preload` imported; returns once it accepts commands. It
    runs until its stdin is closed."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), path, "--preload", ",".join(preload), "--pad", " " * PAD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != b"ready":
        raise RuntimeError(f"the fork server did not start (exit {proc.wait()})")
    return proc


# -- the caller's side --------------------------------------------------------------------------------


class Forked:
    """A forked command, with the `subprocess.Popen` surface unirl and its tests use."""

    def __init__(self, conn: socket.socket, args: list[str], pid: int, stdout: Any, stderr: Any):
        self._conn, self.args, self.pid, self.stdout, self.stderr = conn, args, pid, stdout, stderr
        self.stdin = None
        self._buffer = b""
        self._lock = threading.Lock()
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            if self.returncode is None:
                line, self._buffer = _line(self._conn, self._buffer, timeout, self.args)
                self.returncode = int(line.removeprefix("exit "))
                self._conn.close()
            return self.returncode
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        """As Popen's: None while it runs, or while another thread waits for it."""
        if self.returncode is not None or not self._lock.acquire(blocking=False):
            return self.returncode
        self._lock.release()
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

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def _line(conn: socket.socket, buffer: bytes, timeout: float | None, args: Any) -> tuple[str, bytes]:
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buffer:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            raise subprocess.TimeoutExpired(args, timeout if timeout is not None else 0.0) from None
        if not chunk:
            raise RuntimeError(f"the fork server went away while {args} ran")
        buffer += chunk
    line, buffer = buffer.split(b"\n", 1)
    return line.decode(), buffer


def popen(path: str, cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False, errors: str | None = None,
          start_new_session: bool = False, watch: bool = False, modules: tuple[str, ...] | None = FORKABLE,
          strict: bool = True, parent: int | None = None) -> Forked | None:
    """`subprocess.Popen(cmd, ...)` forked by the server at `path`; None when it cannot be: not
    `python -m` of one of `modules` (None: any), no server there, or (`strict`) a setting the
    server's preloaded libraries read at import differs. Start it fresh then."""
    if not (len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and (modules is None or cmd[2] in modules)):
        return None
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
            return opened[-1], open(mine, mode if text else mode + "b", encoding="utf-8" if text else None,
                                    errors=errors if text else None)
        if isinstance(spec, int):
            return spec, None
        return spec.fileno(), None

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    ours: list[Any] = []
    try:
        in_fd, _ = fd(stdin, 0, "w")
        out_fd, out = fd(stdout, 1, "r")
        err_fd, err = (out_fd, None) if stderr == subprocess.STDOUT else fd(stderr, 2, "r")
        ours = [f for f in (out, err) if f is not None]
        command = {"module": cmd[2], "args": list(cmd[3:]), "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "new_session": start_new_session, "watch": watch,
                   "strict": strict, "parent": parent}
        socket.send_fds(conn, [json.dumps(command).encode()], [in_fd, out_fd, err_fd])
        line, rest = _line(conn, b"", None, cmd)
    except BaseException:
        conn.close()
        for f in ours:
            f.close()
        raise
    finally:
        for fd_ in opened:
            os.close(fd_)
    if not line.startswith("pid "):  # refused: a setting read at import differs
        conn.close()
        for f in ours:
            f.close()
        return None
    proc = Forked(conn, cmd, int(line.removeprefix("pid ")), out, err)
    proc._buffer = rest
    return proc


def proxy(path: str, cmd: list[str]) -> int:
    """Be `cmd` for a parent that must start it itself (torchrun starts each rank): the server
    forks it with this process's stdio and environment, this process passes the signals it gets
    on and exits as the command does (a command killed by a signal, by the same signal). Killed
    itself, it takes the command with it."""
    from unirl.stages.runtime.processes import die_with_parent

    die_with_parent()  # the rank's parent is torchrun's agent: its death takes this proxy, and with it the rank
    proc = popen(path, cmd, start_new_session=True, watch=True, parent=os.getppid(), modules=None)
    if proc is None:
        os.execv(cmd[0], cmd)  # started fresh, in place
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    # The children run unirl, which loads its launch hook as HOOK: let it find this module, whose
    # PARENT a forked child sets, rather than load a second copy of the file.
    sys.modules.setdefault(HOOK, sys.modules[__name__])
    if argv[:1] == ["--exec"]:
        return proxy(argv[1], argv[2:])
    parser = argparse.ArgumentParser(prog="python tests/forkserver.py")
    parser.add_argument("socket")
    parser.add_argument("--preload", default="", help="modules to import before serving (comma-separated)")
    parser.add_argument("--pad", default="", help="room in argv for the children's command lines")
    args = parser.parse_args(argv)
    job = serve(args.socket, [m for m in args.preload.split(",") if m])
    if job is None:
        return 0
    leave(run_child(job))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

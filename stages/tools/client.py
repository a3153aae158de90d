"""A tool server over stdio (the `mcp` package's client), as a run uses it: started on first use
(in the sandbox unless told otherwise), every call bounded (a timeout, an output cap), and every
failure an observation the trajectory records instead of an exception: a malformed call, a tool
that raises, one that hangs (the server is stopped and started again), a result too large or not
text, a server that died or was stopped by the sandbox for a limit (started again, up to `restarts`
times in a row with no call answered in between; after that every call answers that the server is
down).

The server's environment is an allow-list (`tool_env`): the run's credentials (object-store keys,
MLflow and reward tokens) never reach a tool unless the recipe names them in `pass_env`.

The client runs the MCP session in one task of its own event loop, in a thread: calls from the
rollout's thread queue up and are answered in order.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unirl.stages.runtime.processes import Limits
from unirl.stages.tools import ToolSpec
from unirl.stages.tools.sandbox import STOPPED

# What a tool server's environment holds of the run's, besides what the recipe names (`pass_env`):
# enough to find programs and start the run's interpreter, never a credential.
PASSED_ENV = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                        "LD_LIBRARY_PATH", "UNIRL_PLUGINS"})


def tool_env(scratch: Path, env: dict[str, str], pass_env: tuple[str, ...] | list[str] = (), where: str = "agent") -> dict[str, str]:
    """A tool server's whole environment: the allow-list above (and the LC_* locale), a home and
    temporary folder inside its scratch folder, the run's variables named in `pass_env`, then
    `env`. A `pass_env` name the run does not have is an error naming it (`where`)."""
    out = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith("LC_")}
    missing = [name for name in pass_env if name not in os.environ]
    if missing:
        raise ToolServerDown(f"{where}.pass_env names {missing}, which this process's environment does not have: "
                             "set them where the run starts (its worker's environment) or drop them from pass_env")
    out.update({name: os.environ[name] for name in pass_env})
    out.update(HOME=str(scratch), TMPDIR=str(scratch))
    out.update(env)
    return out


@dataclass
class Observation:
    """What one call gave: its text (the tool turn the policy reads) or its error, and how long it took."""

    text: str
    error: str | None
    latency_s: float


class ToolServerDown(RuntimeError):
    """A tool server that cannot be started (its command fails before it answers)."""


@dataclass
class ServerSpec:
    """How to start one MCP server over stdio."""

    name: str
    command: list[str]
    env: dict[str, str]
    scratch: Path
    sandbox: bool = True
    limits: Limits = Limits()
    pass_env: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_chars: int = 4096
    restarts: int = 3
    startup_timeout_s: float = 60.0


class ToolServer:
    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.specs: dict[str, ToolSpec] = {}
        self.starts = 0
        self.in_a_row = 0  # starts since a call was last answered
        self.down: str | None = None
        self._queue: asyncio.Queue | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tools-{spec.name}", daemon=True)
        self._thread.start()
        self._ready: Future = Future()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._loop)
        try:
            self._ready.result(timeout=spec.startup_timeout_s)
        except Exception:
            self.close()
            raise

    # -- the session task ----------------------------------------------------------------------
    def _params(self) -> Any:
        from mcp import StdioServerParameters  # start-up time: mcp loads on first use, not when a recipe is read

        s = self.spec  # its scratch folder exists: `_main` makes it before the first start
        command = list(s.command)
        if s.sandbox:
            lim = s.limits
            command = [sys.executable, "-m", "unirl.stages.tools.sandbox", "--scratch", str(s.scratch), "--cpu-s", str(lim.cpu_s),
                       "--memory-mb", str(lim.memory_mb), "--files", str(lim.files), "--procs", str(lim.procs), "--", *command]
        return StdioServerParameters(command=command[0], args=command[1:], env=tool_env(s.scratch, s.env, s.pass_env, s.name),
                                     cwd=str(s.scratch), encoding_error_handler="replace")

    @property
    def _errlog(self) -> Path:
        return self.spec.scratch.parent / f"{self.spec.name}.stderr.log"

    def _stop_reason(self, since: int) -> str:
        """The sandbox's last `stopped:` line written since byte `since` of the server's stderr log ('' if none)."""
        try:
            with open(self._errlog, "rb") as f:
                f.seek(since)
                tail = f.read(1 << 16).decode("utf-8", "replace")
        except OSError:
            return ""
        lines = [line[len(STOPPED):].strip() for line in tail.splitlines() if line.startswith(STOPPED)]
        return lines[-1] if lines else ""

    async def _main(self) -> None:
        from mcp import ClientSession  # start-up time: mcp loads on first use, not when a recipe is read
        from mcp.client.stdio import stdio_client

        self._queue = asyncio.Queue()
        self.spec.scratch.mkdir(parents=True, exist_ok=True)
        pending: tuple[str, dict[str, Any], Future] | None = None
        while True:
            self.starts += 1
            self.in_a_row += 1
            since = self._errlog.stat().st_size if self._errlog.exists() else 0
            try:
                with open(self._errlog, "a") as errlog:
                    async with stdio_client(self._params(), errlog=errlog) as (read, write), ClientSession(read, write) as session:
                        await asyncio.wait_for(session.initialize(), self.spec.startup_timeout_s)
                        listed = await session.list_tools()
                        self.specs = {t.name: ToolSpec(t.name, t.description or "", dict(t.input_schema)) for t in listed.tools}
                        if not self._ready.done():
                            self._ready.set_result(True)
                        while True:
                            if pending is None:
                                pending = await self._queue.get()
                            if pending[2] is None:  # close()
                                return
                            name, args, fut = pending
                            result, restart = await self._call(session, name, args)
                            pending = None
                            fut.set_result(result)
                            if restart:
                                break  # stop the server (a hung call may still run in it) and start it again
                            self.in_a_row = 0  # a call answered: the server works
            except Exception as exc:  # noqa: BLE001 - a server that died or never answered
                if not self._ready.done():
                    self._ready.set_exception(ToolServerDown(self._start_error(exc)))
                    return
                if pending is not None:  # the call in flight when the server went away: answered, not asked again
                    reason = self._stop_reason(since) or type(exc).__name__
                    pending[2].set_result(Observation("", f"tool server {self.spec.name!r} died during {pending[0]} "
                                                          f"({reason}); it is started again", 0.0))
                    pending = None
            if self.in_a_row > self.spec.restarts:
                self.down = (f"tool server {self.spec.name!r} is down (died {self.in_a_row} times with no call answered in "
                             f"between; agent.restarts {self.spec.restarts})")
                while True:
                    name, args, fut = await self._queue.get()
                    if fut is None:
                        return
                    fut.set_result(Observation("", self.down, 0.0))

    def _start_error(self, exc: BaseException) -> str:
        log = self._errlog
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        hint = " (agent.sandbox: the sandbox needs CAP_SYS_ADMIN or user namespaces; false runs tools unsandboxed)" \
            if "tool sandbox" in tail else ""
        return f"tool server {self.spec.name!r} ({' '.join(self.spec.command)}) did not start: {type(exc).__name__}{hint}\n{tail}"

    async def _call(self, session: Any, name: str, args: dict[str, Any]) -> tuple[Observation, bool]:
        """(observation, whether the server must be started again)."""
        start = time.perf_counter()
        from mcp.shared.exceptions import MCPError  # start-up time: mcp loads on first use, not when a recipe is read
        from mcp.types import REQUEST_TIMEOUT

        try:
            result = await session.call_tool(name, args, read_timeout_seconds=self.spec.timeout_s)
        except MCPError as exc:
            if exc.code != REQUEST_TIMEOUT:
                raise
            # the tool still runs in the server: stop it and start it again
            return Observation("", f"{name} timed out after {self.spec.timeout_s:g}s", time.perf_counter() - start), True
        latency = time.perf_counter() - start
        text = "\n".join(getattr(c, "text", "") for c in getattr(result, "content", []) or [] if getattr(c, "type", "") == "text")
        if len(text) > self.spec.max_chars:
            text = text[:self.spec.max_chars] + f"... [cut: {len(text) - self.spec.max_chars} more characters]"
        if getattr(result, "is_error", False):
            return Observation("", f"{name} failed: {text[:500]}", latency), False
        return Observation(text, None, latency), False

    # -- the rollout's side ------------------------------------------------------------------------
    def call(self, name: str, args: dict[str, Any]) -> Observation:
        """One call, answered within the timeout (plus the time to start a server again)."""
        fut: Future = Future()
        assert self._queue is not None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (name, args, fut))
        return fut.result(timeout=self.spec.timeout_s + self.spec.startup_timeout_s + 5)

    def close(self) -> None:
        if self._queue is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ("", {}, None))
            try:
                self._task.result(timeout=10)
            except Exception:  # noqa: BLE001 - closing what may have failed
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def python_tools_server(names: list[str], scratch: Path, **options: Any) -> ToolServer:
    """unirl's MCP server of the registered Python tools `names` (stages/tools/serve.py)."""
    command = [sys.executable, "-m", "unirl.stages.tools.serve", *[a for n in names for a in ("--tool", n)],
               "--max-chars", str(options.get("max_chars", 4096))]
    return ToolServer(ServerSpec("python-tools", command, options.pop("env", {}), scratch, **options))

"""Tools that misbehave in every way a tool can, for tests/stages/tools/ and the agentic runs of
tests/e2e/test_agent_flow.py (registered through UNIRL_PLUGINS=tests.agent_tools in the tool
server's process)."""
from __future__ import annotations

import os
import socket
import time

from unirl.stages.tools import register_tool


@register_tool("echo")
def echo(text: str) -> str:
    """The text back.

    Args:
        text: what to send back.
    """
    return text


@register_tool("add")
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


@register_tool("boom")
def boom() -> str:
    """Raises."""
    raise RuntimeError("the tool broke")


@register_tool("sleepy")
def sleepy(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


@register_tool("huge")
def huge(n: int) -> str:
    """A long answer."""
    return "x" * n


@register_tool("binary")
def binary() -> bytes:
    """Bytes that are not UTF-8."""
    return b"\xff\xfe\x00"


@register_tool("dial")
def dial(port: int) -> str:
    """Connects to a port on the host."""
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


@register_tool("write")
def write(path: str) -> str:
    """Writes a file."""
    with open(path, "w") as f:
        f.write("x")
    return f"wrote {os.path.abspath(path)}"


@register_tool("die")
def die() -> str:
    """Ends the server's process."""
    os._exit(1)


@register_tool("sum")
def sum_(a: int, b: int) -> int:
    """The sum of two integers; the first call a server gets in its scratch folder ends the server."""
    if not os.path.exists("sum-died"):  # the working folder is the server's scratch folder, kept across its restarts
        open("sum-died", "w").close()
        os._exit(1)
    return a + b


@register_tool("peek")
def peek(names: list[str], values: list[str]) -> dict:
    """What of the run a tool can see: the variables `names` in its environment, and every process
    whose environment holds one of `values` (/proc/<pid>/environ)."""
    seen = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                held = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        hits = [v for v in values if v in held]
        if hits:
            seen[pid] = hits
    return {"env": {n: os.environ[n] for n in names if n in os.environ}, "processes": seen}


@register_tool("fork_bomb")
def fork_bomb() -> str:
    """Forks without end (every child too)."""
    while True:
        try:
            os.fork()
        except OSError:
            pass


@register_tool("hog")
def hog(mb: int, processes: int = 1) -> str:
    """Holds `mb` MiB in each of `processes` processes (itself and children) for a while."""
    for _ in range(processes - 1):
        if os.fork() == 0:
            break
    held = bytearray(mb << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    time.sleep(30)
    return f"held {len(held) >> 20} MiB"


@register_tool("spin")
def spin() -> str:
    """Computes without end."""
    n = 0
    while True:
        n += 1

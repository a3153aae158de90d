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

"""unirl's MCP server of registered Python tools, over stdio:

    python -m unirl.stages.tools.serve --tool lookup --tool calc [--max-chars 4096]

A tool's answer is text: a str as it is, numbers and booleans as JSON, lists and dicts as JSON; a
result over `--max-chars` is cut (the answer says so), bytes that are not UTF-8 and anything
without a text form are an error answer, and an exception is an error answer with its message,
never a dead server. Run by stages/tools/client.py, in the sandbox (stages/tools/sandbox.py).
"""
from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from unirl.stages.runtime.registry import tools


def as_text(value: Any, max_chars: int) -> str:
    """A tool result as the text the policy reads; ValueError when it has none."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the tool returned bytes that are not UTF-8 text") from None
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except TypeError:
            raise ValueError(f"the tool returned a {type(value).__name__}, which has no text form") from None
    if len(value) > max_chars:
        value = value[:max_chars] + f"... [cut: {len(value) - max_chars} more characters]"
    return value


def build(names: list[str], max_chars: int) -> Any:
    from mcp.server.mcpserver import MCPServer  # start-up time: mcp loads on first use, not when a recipe is read
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("unirl-tools")
    for name in names:
        entry = tools.get(name)

        @functools.wraps(entry.fn)
        def call(*args: Any, _fn: Any = entry.fn, **kwargs: Any) -> str:
            try:
                return as_text(_fn(*args, **kwargs), max_chars)
            except Exception as exc:  # noqa: BLE001 - the policy reads what went wrong, the server goes on
                raise ToolError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc

        server.tool(name=name, description=entry.spec.description, structured_output=False)(call)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", action="append", required=True, help="a registered tool's name (repeat)")
    parser.add_argument("--max-chars", type=int, default=4096)
    args = parser.parse_args(argv)
    build(args.tool, args.max_chars).run("stdio")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

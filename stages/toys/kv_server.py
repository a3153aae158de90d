"""The key-value toy's MCP server over stdio (stages/toys/kvstore.py): `lookup(key)` and
`calc(expression)`, for the store of `--seed` and `--size`.

    python -m unirl.stages.toys.kv_server --seed 0 --size 60
"""
from __future__ import annotations

import argparse

from unirl.stages.toys.kvstore import calc, make_store


def build(seed: int, size: int):
    from mcp.server.mcpserver import MCPServer  # start-up time: mcp loads on first use, not when a recipe is read
    from mcp.server.mcpserver.exceptions import ToolError

    store = make_store(seed, size)
    server = MCPServer("unirl-kvstore")

    @server.tool(name="lookup", description="The value stored under a key.", structured_output=False)
    def lookup(key: str) -> str:
        if key not in store:
            raise ToolError(f"no key {key[:20]!r}")
        return str(store[key])

    @server.tool(name="calc", description="The value of an integer expression (+ - * and parentheses).",
                 structured_output=False)
    def calculate(expression: str) -> str:
        try:
            return str(calc(expression))
        except (ValueError, SyntaxError) as exc:
            raise ToolError(str(exc)) from None

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=60)
    args = parser.parse_args(argv)
    build(args.seed, args.size).run("stdio")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

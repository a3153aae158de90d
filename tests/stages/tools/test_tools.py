"""Tools as a run calls them: schemas from signatures, calls parsed from the policy's text, and a
real MCP server over stdio (unirl's server of Python tools, in the sandbox) answering every fault
with an observation: a raising tool, a hanging one (the server is started again), a huge or
non-UTF-8 result, a server that died, a tool reaching for the network or writing outside its
scratch folder."""
from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from unirl.stages.tools import schema_of
from unirl.stages.tools.calls import parse, render

REPO = Path(__file__).resolve().parents[3]


def test_a_schema_comes_from_the_signature_and_the_docstring():
    def lookup(key: str, default: int = 0, tags: list[str] | None = None) -> str:
        """The value under a key.

        Args:
            key: the key to look up.
            default: what a missing key gives.
        """
        return key

    with pytest.raises(ValueError, match=r"tool 'lookup', parameter 'tags': annotation .* has no JSON schema type"):
        schema_of("lookup", lookup)

    def lookup2(key: str, default: int = 0) -> str:
        """The value under a key.

        Args:
            key: the key to look up.
        """
        return key

    spec = schema_of("lookup", lookup2)
    assert spec.description == "The value under a key."
    assert spec.parameters == {"type": "object", "required": ["key"], "properties": {
        "key": {"type": "string", "description": "the key to look up."}, "default": {"type": "integer"}}}


@pytest.mark.parametrize(("fn", "message"), [
    (lambda x: x, r"tool 't', parameter 'x': no type annotation"),
    (eval("lambda *a: 0"), r"\*args / \*\*kwargs cannot be described"),
])
def test_a_tool_the_policy_cannot_be_told_about_is_refused(fn, message):
    fn.__doc__ = "A tool."
    with pytest.raises(ValueError, match=message):
        schema_of("t", fn)


def test_calls_are_parsed_and_every_malformed_one_says_why():
    text = (f"let me look {render('lookup', {'key': 'apple'})} and {render('calc', {'expr': '1+2'})}"
            '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call><tool_call>{nope}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{"name": "lookup"')
    calls = parse(text, {"lookup", "calc"})
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [("lookup", {"key": "apple"}, True),
                                                                            ("calc", {"expr": "1+2"}, True)]
    assert calls[2].error == "arguments must be an object"
    assert calls[3].error.startswith("not JSON")
    assert calls[4].error == "unknown tool 'rm' (tools: calc, lookup)"
    assert "without its </tool_call>" in calls[5].error and len(calls) == 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from unirl.stages.tools.client import ServerSpec, ToolServer

    scratch = tmp_path_factory.mktemp("tools") / "scratch"
    command = ["python", "-m", "unirl.stages.tools.serve", "--max-chars", "100",
               *[a for n in ("echo", "add", "boom", "sleepy", "huge", "binary", "dial", "write", "die") for a in ("--tool", n)]]
    import sys
    command[0] = sys.executable
    spec = ServerSpec("test-tools", command, {"UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)}, scratch,
                      timeout_s=3.0, max_chars=200, restarts=3)
    srv = ToolServer(spec)
    yield srv
    srv.close()


def test_the_server_lists_the_tools_and_answers_calls(server):
    assert {"echo", "add", "sleepy"} <= set(server.specs)
    assert server.specs["add"].parameters["required"] == ["a", "b"]
    got = server.call("echo", {"text": "héllo"})
    assert (got.text, got.error) == ("héllo", None) and got.latency_s > 0
    assert server.call("add", {"a": 2, "b": 40}).text == "42"


def test_faults_are_observations(server):
    raised = server.call("boom", {})
    assert raised.error.startswith("boom failed:") and "the tool broke" in raised.error
    cut = server.call("huge", {"n": 10_000})
    assert cut.error is None and cut.text.startswith("x" * 100) and cut.text.endswith("[cut: 9900 more characters]")
    assert "not UTF-8" in server.call("binary", {}).error
    bad_args = server.call("add", {"a": "two", "b": 1})
    assert bad_args.error is not None and bad_args.error.startswith("add failed")
    starts = server.starts
    hung = server.call("sleepy", {"seconds": 30})
    assert hung.error == "sleepy timed out after 3s"
    assert server.call("echo", {"text": "again"}).text == "again" and server.starts == starts + 1  # started again
    died = server.call("die", {})
    assert died.error is not None and "died" in died.error
    assert server.call("echo", {"text": "back"}).text == "back"  # started again after it died


def test_tools_reach_no_network_and_write_only_in_their_scratch_folder(server, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    threading.Thread(target=lambda: listener.accept(), daemon=True).start()
    blocked = server.call("dial", {"port": listener.getsockname()[1]})
    assert blocked.error is not None and "unreachable" in blocked.error.lower(), blocked
    outside = server.call("write", {"path": str(tmp_path / "outside.txt")})
    assert "Read-only file system" in outside.error and not (tmp_path / "outside.txt").exists()
    inside = server.call("write", {"path": "notes.txt"})
    assert inside.error is None and (server.spec.scratch / "notes.txt").exists()
    listener.close()


def test_a_toolbox_routes_each_call_to_the_server_that_has_the_tool(tmp_path):
    """The recipe's Python tools on unirl's server and an MCP server of its own (here: the same
    program, started by its command line), one box."""
    from unirl.stages.tools.config import AgentConfig
    from unirl.stages.tools.engine import ToolBox

    cfg = AgentConfig(tools=[], mcp_servers=[
        {"name": "sums", "command": ["python", "-m", "unirl.stages.tools.serve", "--tool", "add"],
         "env": {"UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)}},
        {"name": "words", "command": ["python", "-m", "unirl.stages.tools.serve", "--tool", "echo"],
         "env": {"UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)}}])
    box = ToolBox(cfg, tmp_path)
    try:
        assert sorted(box.route) == ["add", "echo"] and [s.name for s in box.specs] == ["add", "echo"]
        assert box.call("add", {"a": 1, "b": 2}).text == "3" and box.call("echo", {"text": "hi"}).text == "hi"
        assert box.route["add"] is not box.route["echo"]
    finally:
        box.close()


def validate_with_bad_tool(tmp_path):
    """`unirl validate` of the tiny recipe with tests/agent_bad_tools.py's `fetch_page` in agent.tools."""
    import os

    from tests.conftest import TINY, run_unirl

    env = {**os.environ, "UNIRL_PLUGINS": "tests.agent_bad_tools", "PYTHONPATH": str(REPO)}
    return run_unirl(["validate", str(TINY), "agent={tools: [fetch_page]}", f"storage.root={tmp_path / 'runs'}"], env,
                     timeout=120, check=False)


def test_a_tool_whose_schema_cannot_be_made_stops_validate(tmp_path):
    """Like every other recipe error (exit 2, an `error:` line naming the field, no traceback), and
    nothing of the run starts: the user reads which tool and which parameter."""
    out = validate_with_bad_tool(tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "agent.tools.0: tool 'fetch_page', parameter 'url': no type annotation" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "runs").exists()

"""Tools as a run calls them: schemas from signatures, calls parsed from the policy's text, and a
real MCP server over stdio (unirl's server of Python tools, in the sandbox) answering every fault
with an observation: a raising tool, a hanging one (the server is started again), a huge or
non-UTF-8 result, a server that died, a tool reaching for the network or writing outside its
scratch folder."""
from __future__ import annotations

import socket
import sys
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


SECRETS = {"AWS_SECRET_ACCESS_KEY": "s3-key-do-not-leak", "MLFLOW_TRACKING_TOKEN": "mlflow-token-do-not-leak",
           "UNIRL_REWARD_TOKEN": "reward-token-do-not-leak"}


@pytest.mark.parametrize("sandbox", [True, False])
def test_a_tool_gets_none_of_the_run_s_secrets(tmp_path, monkeypatch, sandbox):
    """The run's object-store key, MLflow token and reward token are in its environment; a tool
    reading its own environment and every process's /proc/<pid>/environ finds none of them, sandboxed
    or not (not sandboxed it still sees the run's processes: only the environment is cut). A name
    the recipe passes knowingly (`pass_env`) does arrive."""
    import json

    from unirl.stages.tools.client import ServerSpec, ToolServer

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOOL_API_KEY", "passed-knowingly")
    command = [sys.executable, "-m", "unirl.stages.tools.serve", "--tool", "peek"]
    server = ToolServer(ServerSpec("peek", command, {"UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)},
                                   tmp_path / "scratch", sandbox=sandbox, pass_env=("TOOL_API_KEY",)))
    try:
        got = server.call("peek", {"names": [*SECRETS, "TOOL_API_KEY", "HOME"], "values": list(SECRETS.values())})
    finally:
        server.close()
    assert got.error is None, got
    seen = json.loads(got.text)
    assert seen["env"] == {"TOOL_API_KEY": "passed-knowingly", "HOME": str(tmp_path / "scratch")}
    if sandbox:
        assert seen["processes"] == {}, seen  # the run's processes are out of its sight
    else:
        assert all(pid.isdigit() for pid in seen["processes"])  # what the sandbox is for


def test_a_pass_env_name_the_run_lacks_is_an_error_naming_it(tmp_path, monkeypatch):
    from unirl.stages.tools.client import ToolServerDown, tool_env

    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    with pytest.raises(ToolServerDown, match=r"searcher.pass_env names \['NOT_SET_HERE'\]"):
        tool_env(tmp_path, {}, ("NOT_SET_HERE",), "searcher")


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A sandboxed server with small limits and a timeout longer than its CPU limit."""
    from unirl.stages.tools.client import ServerSpec, ToolServer
    from unirl.stages.tools.sandbox import Limits

    command = [sys.executable, "-m", "unirl.stages.tools.serve",
               *[a for n in ("echo", "fork_bomb", "hog", "spin") for a in ("--tool", n)]]
    spec = ServerSpec("limited", command, {"UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)},
                      tmp_path_factory.mktemp("limited") / "scratch", limits=Limits(cpu_s=4, memory_mb=300, procs=16),
                      timeout_s=60.0, restarts=1)
    srv = ToolServer(spec)
    yield srv
    srv.close()


@pytest.mark.parametrize("call, stopped", [
    (("fork_bomb", {}), "process limit"),
    (("hog", {"mb": 100, "processes": 4}), "memory limit"),
    (("spin", {}), "CPU limit"),
])
def test_a_tool_past_a_limit_is_stopped_and_the_run_goes_on(limited, call, stopped):
    """A fork bomb, memory held across processes and a computation without end each stop the server
    within seconds (not at the call's 60 s timeout); the call answers why, and the next call is
    answered by the server started again (`restarts: 1` counts deaths in a row, so three in one
    session do not take it down)."""
    got = limited.call(*call)
    assert got.error is not None and stopped in got.error and "died during" in got.error, got
    assert got.latency_s < 30
    assert limited.call("echo", {"text": "still here"}).text == "still here"
    assert limited.down is None


def test_one_process_asking_past_the_memory_limit_gets_an_error_answer(limited):
    got = limited.call("hog", {"mb": 1024})
    assert got.error is not None and "MemoryError" in got.error, got
    assert limited.call("echo", {"text": "same server"}).text == "same server"


def test_a_sandbox_step_that_fails_stops_the_server_naming_it(tmp_path):
    """Fails closed: here the tool's own user namespace (the process limit's step) cannot be made,
    because the namespace the sandbox runs in allows no more (max_user_namespaces 0); nothing runs."""
    import shutil
    import subprocess

    if not shutil.which("unshare"):
        pytest.skip("needs util-linux unshare to make a namespace that allows no user namespaces")
    script = (f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -m unirl.stages.tools.sandbox "
              f"--scratch {tmp_path / 's'} -- {sys.executable} -c 'open(\"ran\", \"w\")'")
    out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script], capture_output=True, text=True,
                         timeout=60)
    if "max_user_namespaces" in out.stderr:
        pytest.skip(f"cannot set max_user_namespaces here: {out.stderr}")
    assert out.returncode == 3 and "process limit: cannot enter a user namespace" in out.stderr, out
    assert not (tmp_path / "s" / "ran").exists()


def test_a_toolbox_routes_each_call_to_the_server_that_has_the_tool(tmp_path):
    """The recipe's Python tools on unirl's server and an MCP server of its own (here: the same
    program, started by its command line), one box."""
    from unirl.stages.engines.agentic import ToolBox
    from unirl.stages.sections import AgentConfig

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

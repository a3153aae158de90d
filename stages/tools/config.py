"""The recipe's `agent` section: a multi-turn run whose policy calls tools (stages/tools/agent.py)."""
from __future__ import annotations

from pydantic import Field, field_validator

from unirl.stages.runtime.config_base import Section
from unirl.stages.tools.sandbox import Limits


def _variable_names(names: list[str]) -> list[str]:
    bad = [n for n in names if not n or not (n[0].isalpha() or n[0] == "_") or not n.replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"{bad}: environment variable names (letters, digits and _, not starting with a digit)")
    return names


class ToolLimits(Section):
    """What a sandboxed tool server may use (stages/tools/sandbox.py); a server past a limit is
    stopped, the call that was running answers why, and the server is started again."""

    cpu_s: int = Field(Limits.cpu_s, ge=1, description="CPU seconds each of its processes may use in its lifetime.")
    memory_mb: int = Field(Limits.memory_mb, ge=64, description="Memory: an allocation past it fails in the process that asks; all "
                           "its processes together resident past it stop the server.")
    files: int = Field(Limits.files, ge=16, description="Open files per process.")
    procs: int = Field(Limits.procs, ge=2, description="Processes at once (the server's own included).")


class MCPServerConfig(Section):
    """An MCP server over stdio whose tools the policy may call."""

    name: str = Field(description="What the run calls it (logs, errors).")
    command: list[str] = Field(min_length=1, description="Its command line, e.g. [python, -m, my_tools.server] (`python` "
                               "first: the run's own interpreter).")
    env: dict[str, str] = Field(default_factory=dict, description="Variables it gets (values written here; the run's own "
                                "environment does not reach a tool server).")
    pass_env: list[str] = Field(default_factory=list, description="Names of the run's environment variables it gets "
                                "(a credential a tool needs, named knowingly).")

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        return _variable_names(names)

    @field_validator("name")
    @classmethod
    def _plain(cls, name: str) -> str:
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{name!r}: letters, digits, - and _ only")
        return name


class AgentConfig(Section):
    """Multi-turn rollouts with tools: the policy writes a turn, its tool calls run, their results
    come back as a tool turn, until it answers (docs/agentic.md)."""

    tools: list[str] = Field(default_factory=list, description="Registered Python tools (stages/tools: @register_tool), "
                             "served by unirl's own MCP server.")
    mcp_servers: list[MCPServerConfig] = Field(default_factory=list, description="More tools, from MCP servers over stdio.")
    max_turns: int = Field(4, ge=1, le=64, description="Assistant turns of a trajectory at most.")
    timeout_s: float = Field(10.0, gt=0, description="Longest a tool call may take (the server is started again after).")
    max_chars: int = Field(1024, ge=16, description="Characters of a tool result the policy reads at most (the rest is cut).")
    sandbox: bool = Field(True, description="Run tool servers with no network, no writes outside a scratch folder, their "
                          "own process namespace and `limits` (needs CAP_SYS_ADMIN or user namespaces; a run whose "
                          "sandbox cannot be made stops, naming the step).")
    limits: ToolLimits = Field(default_factory=ToolLimits, description="What a sandboxed tool server may use.")
    pass_env: list[str] = Field(default_factory=list, description="Names of the run's environment variables unirl's "
                                "server of Python tools gets (nothing else of the run's environment reaches it).")
    restarts: int = Field(3, ge=0, description="Times in a row a tool server that died or hung is started again with no "
                          "call answered in between (then every call answers that it is down).")

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        return _variable_names(names)

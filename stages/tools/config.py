"""The recipe's `agent` section: a multi-turn run whose policy calls tools (stages/tools/agent.py)."""
from __future__ import annotations

from pydantic import Field, field_validator

from unirl.stages.runtime.config_base import Section


class MCPServerConfig(Section):
    """An MCP server over stdio whose tools the policy may call."""

    name: str = Field(description="What the run calls it (logs, errors).")
    command: list[str] = Field(min_length=1, description="Its command line, e.g. [python, -m, my_tools.server] (`python` "
                               "first: the run's own interpreter).")
    env: dict[str, str] = Field(default_factory=dict, description="Variables it gets besides the run's.")

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
    sandbox: bool = Field(True, description="Run tool servers with no network and no writes outside a scratch folder "
                          "(needs CAP_SYS_ADMIN or user namespaces).")
    restarts: int = Field(3, ge=0, description="Times a tool server that died or hung is started again in one process.")

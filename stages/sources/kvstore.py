"""`data.name: kvstore`: questions over a key-value store reachable only through tools
(stages/toys/kvstore.py; its MCP server, stages/toys/kv_server.py, serves `lookup` and `calc`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source
from unirl.stages.toys.kvstore import KVStore, teacher_records

SERVER = "unirl.stages.toys.kv_server"


class KVStoreData(Section):
    """Questions `abc+dfe=` over a store made fresh from `seed`; the answer is the sum of the two values."""

    name: Literal["kvstore"] = "kvstore"
    seed: int = Field(0, ge=0, description="Seed of the store, its key split and the questions (the tool server's --seed).")
    size: int = Field(60, ge=15, le=10_000, description="Keys in the store (the tool server's --size).")
    heldout_size: int = Field(20, ge=0, description="Questions in each of the dev and test splits.")


@sources.register("kvstore")
class KVStoreSource(Source):
    name = "kvstore"
    config = KVStoreData

    @classmethod
    def build(cls, cfg: Any) -> Any:
        return KVStore(cfg.seed, cfg.size, cfg.heldout_size)

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """An imperfect teacher's transcripts (stages/toys/kvstore.py `teacher_records`), each over a
        store of its own: two lookups, a calc, the answer; `sft.noise` of them slip (the sum guessed
        without calc, or a malformed calc call)."""
        return teacher_records(recipe.sft.seed, recipe.sft.examples, recipe.sft.noise)

    @classmethod
    def check(cls, recipe: Any) -> None:
        """The store's tool server, where the recipe runs it, serves this store (its --seed, --size)."""
        agent = getattr(recipe, "agent", None)
        for i, server in enumerate(agent.mcp_servers if agent is not None else []):
            if SERVER not in server.command:
                continue
            for flag, want, default in (("--seed", recipe.data.seed, "0"), ("--size", recipe.data.size, "60")):
                given = server.command[server.command.index(flag) + 1] if flag in server.command[:-1] else default
                if given != str(want):
                    raise ValueError(f"agent.mcp_servers.{i}.command: {flag} {given} serves another store than data "
                                     f"({flag.strip('-')} {want}); give the server {flag} {want}")

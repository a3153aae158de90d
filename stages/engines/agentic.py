"""An agentic run's rollout engine: any engine (trainside, engine_server, vllm, ...) wrapped so that
`generate` samples multi-turn trajectories (stages/tools/agent.py) instead of one answer, with the
tools of the recipe's `agent` section. Everything else (weights, sync, release) is the wrapped
engine's; the run loop, its tasks and the async producer do not know the difference.

Each assistant turn is one `generate` of the wrapped engine on a token-level requests shard (one
request per open trajectory, its whole context as `prompt_ids`, seed tag `turn<t>`), under
`<out_dir>.turns/turn-<t>/`; the trajectories are committed as one shard in `out_dir` (one training
row each, tool tokens masked) and their transcripts as `<out_dir>.turns/transcript.arrow` (one
row per turn). A generate that dies half-way is redone from its first turn: every turn's seeds
depend on the sample, the turn and the iteration alone, and nothing is committed before the end.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from unirl.stages.models.family import get_family
from unirl.stages.runtime.images import IMAGE_COLUMNS
from unirl.stages.runtime.processes import Limits
from unirl.stages.runtime.sample import read_rollouts, read_shard, table_from_rows, write_shard
from unirl.stages.runtime.scratch import scratch_dir
from unirl.stages.runtime.storage import join
from unirl.stages.runtime.tokenizer import load_tokenizer, uses_chat_template
from unirl.stages.tools.agent import STOPS, Trajectory, run, training_row, turn_rows
from unirl.stages.tools.calls import ToolFormat
from unirl.stages.tools.client import Observation, ServerSpec, ToolServer, python_tools_server


class ToolBox:
    """The run's tool servers in this process (started on first use): unirl's server of the
    recipe's Python tools, and its MCP servers; a call goes to the server that has the tool."""

    def __init__(self, cfg: Any, scratch: Path):
        lim = cfg.limits
        limits = Limits(cpu_s=lim.cpu_s, memory_mb=lim.memory_mb, files=lim.files, procs=lim.procs)
        options = {"sandbox": cfg.sandbox, "limits": limits, "timeout_s": cfg.timeout_s, "max_chars": cfg.max_chars,
                   "restarts": cfg.restarts}
        self.servers: list[ToolServer] = []
        try:
            if cfg.tools:
                self.servers.append(python_tools_server(list(cfg.tools), scratch / "python-tools",
                                                        pass_env=tuple(cfg.pass_env), **options))
            for s in cfg.mcp_servers:  # `python` is this run's interpreter (its venv's)
                command = [sys.executable if s.command[0] == "python" else s.command[0], *s.command[1:]]
                self.servers.append(ToolServer(ServerSpec(s.name, command, dict(s.env), scratch / s.name,
                                                          pass_env=tuple(s.pass_env), **options)))
        except Exception:
            self.close()
            raise
        self.route = {name: server for server in self.servers for name in server.specs}
        missing = sorted(set(cfg.tools) - set(self.route))
        if missing:
            self.close()
            raise ValueError(f"agent.tools: {missing} were not served (the tool server lists {sorted(self.route)})")

    @property
    def specs(self) -> list[Any]:
        return [server.specs[name] for name, server in sorted(self.route.items())]

    def call(self, name: str, args: dict[str, Any]) -> Observation:
        return self.route[name].call(name, args)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []


class AgentEngine:
    """`engine` with multi-turn `generate`; every other attribute is the engine's own."""

    def __init__(self, engine: Any, recipe: Any, storage: Any):
        self.inner, self.recipe, self.storage = engine, recipe, storage
        self._tools: ToolBox | None = None
        self._fmt: ToolFormat | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def tools(self) -> ToolBox:
        if self._tools is None:
            self._tools = ToolBox(self.recipe.agent, scratch_dir(f"unirl-tools-{self.storage.run}-"))
        return self._tools

    def fmt(self) -> ToolFormat:
        """The policy's tokenizer (of the run's initial weights) and chat format; a family whose
        prompts carry images writes the first prompt with its prompt encoder."""
        if self._fmt is None:
            rel = self.storage.weights_rel(0)
            local = self.storage.local_path(rel) or self.storage.get_dir(rel, scratch_dir("unirl-agent-tok-") / "weights")
            family, setting = get_family(self.recipe.model.kind), self.recipe.model.chat_template
            if family.takes_images:
                images = family.prompt_encoder(Path(local), setting)
                self._fmt = ToolFormat(images.tokenizer, images.use_chat, images)
            else:
                tokenizer = load_tokenizer(local)
                self._fmt = ToolFormat(tokenizer, uses_chat_template(tokenizer, setting))
        return self._fmt

    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "") -> dict[str, Any]:
        from unirl.stages.policies.text import context_length  # at call time: policies.text imports this module while it loads

        start = time.perf_counter()
        storage, cfg = self.storage, self.recipe.agent
        fmt, tools = self.fmt(), self.tools()
        specs = tools.specs
        req = read_shard(storage, requests, "requests")
        trajs = []
        # A prompt's images travel with it: into every turn's request (the sampler shows them) and the row (the replay does).
        shown = req.select([c for c in IMAGE_COLUMNS if c in req.schema.names]).to_pylist()
        for gid, prompt, meta, size, media in zip(req.column("group_id").to_pylist(), req.column("prompt").to_pylist(),
                                                  req.column("metadata").to_pylist(), req.column("group_size").to_pylist(), shown):
            first = fmt.first_prompt(prompt, specs, [tuple(g) for g in media["image_grids"]] if media else None)
            trajs += [Trajectory(f"{gid}/{j}", gid, prompt, meta, list(first), media=media) for j in range(size)]
        trajs.sort(key=lambda t: t.sample_id)
        work = f"{out_dir}.turns"

        def generate_turn(open_: list[Trajectory], turn: int) -> list[dict[str, Any]]:
            folder = join(work, f"turn-{turn}")
            rows = [{"group_id": t.sample_id, "prompt": t.prompt, "metadata": t.metadata, "group_size": 1,
                     "iteration": iteration, "prompt_ids": t.ids, **t.media} for t in open_]
            rel = join(folder, "requests.arrow")
            write_shard(storage, rel, table_from_rows(rows, "requests"))
            out = self.inner.generate(rel, join(folder, "rollouts"), iteration, policy_version, greedy=greedy,
                                      seed_tag=f"{seed_tag}turn{turn}")
            table = read_rollouts(storage, out["files"])
            by_id = {r["sample_id"]: r for r in table.select(["sample_id", "response_ids", "response_logprobs",
                                                               "finish_reason", "policy_version"]).to_pylist()}
            return [by_id[f"{t.sample_id}/0"] for t in open_]

        tokenizer = fmt.tokenizer
        run(trajs, generate_turn, tools.call, fmt, set(tools.route), max_turns=cfg.max_turns,
            max_new_tokens=self.recipe.rollout.max_new_tokens, context=context_length(self.recipe.model),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        rows = [{**training_row(t), "iteration": iteration, "parts": ["text"]} for t in trajs]
        for row in rows:
            if row["policy_version"] != policy_version:
                raise RuntimeError(f"trajectory {row['sample_id']!r} was sampled with version {row['policy_version']}, not "
                                   f"{policy_version}")
        rel = join(out_dir, "part-000.arrow")
        write_shard(storage, rel, table_from_rows(rows, "rollouts", ["text"]))
        transcript = join(work, "transcript.arrow")
        write_shard(storage, transcript, table_from_rows([r for t in trajs for r in turn_rows(t)], "turns"))
        return {"files": [rel], "rows": len(rows), "transcripts": transcript, "policy_version": policy_version,
                "response_tokens": sum(sum(r["response_mask"]) for r in rows), "metrics": agent_metrics(trajs),
                "seconds": time.perf_counter() - start}

    def close(self) -> None:
        if self._tools is not None:
            self._tools.close()
            self._tools = None
        self.inner.close()


def agent_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Turns per trajectory, tool calls and their success rate, and the share of each stop reason."""
    n = max(1, len(trajs))
    calls = sum(t.tool_calls for t in trajs)
    stops = Counter(t.stop_reason for t in trajs)
    return {**tool_use("agent", len(trajs), sum(len(t.turns) for t in trajs), calls, sum(t.tool_errors for t in trajs)),
            "agent/tool_calls_mean": calls / n, **{f"agent/stop_{s}": stops.get(s, 0) / n for s in STOPS}}


def tool_use(prefix: str, trajectories: int, turns: int, calls: int, errors: int) -> dict[str, float]:
    """Assistant turns per trajectory (a trajectory's turns are its assistant turns and one tool turn
    per call) and the share of tool calls that gave a result, from totals over `trajectories`."""
    return {f"{prefix}/turns_mean": (turns - calls) / max(1, trajectories),
            f"{prefix}/tool_success": (calls - errors) / calls if calls else 0.0}


def agentic(engine: Any, recipe: Any, storage: Any) -> Any:
    """The run's engine, made multi-turn when the recipe has an `agent` section."""
    return engine if getattr(recipe, "agent", None) is None else AgentEngine(engine, recipe, storage)

"""Multi-turn trajectories: the policy writes an assistant turn; the tool calls in it (the family's
format, stages/tools/calls.py) run and their results come back as a tool turn; again, until the
policy answers without a call or a limit ends it. Engine-agnostic: `generate(prompts, turn)` samples
one assistant turn for each open trajectory from its token ids as they are (an engine's token-level
requests), so the policy's own tokens are never re-tokenized.

A trajectory is stored as one training row, the initial prompt as `prompt_ids` (with its images
and their grids, `media`, for a vision-language model) and everything after it as `response_ids`,
with `response_mask` 1 on the policy's own tokens (trained, their behaviour log-probs recorded) and
0 on tool and template tokens (context, never trained; log-prob 0), and as one row per turn
(`turn_rows`: index, role, tokens, mask, tool, arguments, result, latency, error).
The trajectory's reward and its group advantage apply to every assistant turn of it.

Stop reasons: `answered` (a turn without a call), `max_turns`, `context_full` (the next turn would
not fit the model's context), `malformed_call` (a call that cannot be run as written: not JSON, no
name, an unknown tool, cut off; its error is the last turn's observation).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unirl.stages.tools.calls import Call, ToolFormat, parse
from unirl.stages.tools.client import Observation

STOPS = ("answered", "max_turns", "context_full", "malformed_call")


@dataclass
class Turn:
    index: int
    role: str  # "assistant" | "tool"
    token_ids: list[int]
    logprobs: list[float]
    text: str
    tool: str | None = None
    arguments: str | None = None  # JSON
    result: str | None = None
    error: str | None = None
    latency_s: float | None = None
    finish_reason: str | None = None


@dataclass
class Trajectory:
    sample_id: str
    group_id: str
    prompt: str
    metadata: Any
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    stop_reason: str | None = None
    versions: set[int] = field(default_factory=set)
    media: dict[str, Any] = field(default_factory=dict)  # the prompt's images and grids, in every turn's request and the row

    @property
    def ids(self) -> list[int]:
        """The whole context so far: the prompt and every turn's tokens."""
        return self.prompt_ids + [t for turn in self.turns for t in turn.token_ids]

    @property
    def answer(self) -> str:
        """The last assistant turn's text (what a scorer reads)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def tool_calls(self) -> int:
        return sum(t.role == "tool" for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(t.role == "tool" and t.error is not None for t in self.turns)


def observation_text(call: Call, obs: Observation | None) -> str:
    """What the policy reads of one call: its result, or its error."""
    if call.error is not None:
        return f"error: {call.error}"
    assert obs is not None
    return obs.text if obs.error is None else f"error: {obs.error}"


def run(trajectories: list[Trajectory], generate: Callable[[list[Trajectory], int], list[dict[str, Any]]],
        call_tool: Callable[[str, dict[str, Any]], Observation], fmt: ToolFormat, known: set[str], *,
        max_turns: int, max_new_tokens: int, context: int | None, decode: Callable[[list[int]], str]) -> list[Trajectory]:
    """Run every trajectory to its stop. `generate(open, turn)` answers one row per open trajectory
    (response_ids, response_logprobs, finish_reason, policy_version), in order."""
    open_ = list(trajectories)
    for turn in range(max_turns):
        if not open_:
            break
        rows = generate(open_, turn)
        going = []
        for traj, row in zip(open_, rows):
            resp = list(row["response_ids"])
            traj.versions.add(int(row["policy_version"]))
            text = decode(resp)
            traj.turns.append(Turn(len(traj.turns), "assistant", resp, [float(x) for x in row["response_logprobs"]], text,
                                   finish_reason=row["finish_reason"]))
            calls = parse(text, known)
            if not calls:
                traj.stop_reason = "answered"
                continue
            results, stop = [], None
            for call in calls:
                obs = None if call.error is not None else call_tool(call.name, call.arguments)
                results.append(observation_text(call, obs))
                traj.turns.append(Turn(len(traj.turns), "tool", [], [], "", tool=call.name or None,
                                       arguments=json.dumps(call.arguments, sort_keys=True), result=None if obs is None else obs.text,
                                       error=call.error if call.error is not None else (obs.error if obs else None),
                                       latency_s=None if obs is None else obs.latency_s))
                if call.error is not None:
                    stop = "malformed_call"
            tokens = fmt.encode(fmt.tool_turn(results))
            last = traj.turns[-1]
            last.token_ids, last.logprobs, last.text = tokens, [0.0] * len(tokens), fmt.tool_turn(results)
            if stop is not None:
                traj.stop_reason = stop
            elif context is not None and len(traj.ids) + max_new_tokens > context:
                traj.stop_reason = "context_full"
            else:
                going.append(traj)
        open_ = going
    for traj in open_:
        traj.stop_reason = "max_turns"
    return trajectories


def training_row(traj: Trajectory) -> dict[str, Any]:
    """The trajectory as one text row: the turns after the prompt concatenated, the mask 1 on the
    policy's own tokens only; `text` is the answer (the last assistant turn)."""
    resp, lps, mask = [], [], []
    for t in traj.turns:
        own = t.role == "assistant"
        resp += t.token_ids
        lps += t.logprobs if own else [0.0] * len(t.token_ids)
        mask += [1 if own else 0] * len(t.token_ids)
    last = next((t for t in reversed(traj.turns) if t.role == "assistant"), None)
    return {"sample_id": traj.sample_id, "group_id": traj.group_id, "metadata": traj.metadata, "prompt": traj.prompt,
            "prompt_ids": traj.prompt_ids, "response_ids": resp, "response_logprobs": lps, "response_mask": mask,
            "finish_reason": (last.finish_reason if last else None) or "stop", "text": traj.answer,
            "policy_version": min(traj.versions) if traj.versions else None, "agent_turns": len(traj.turns),
            "agent_tool_calls": traj.tool_calls, "agent_tool_errors": traj.tool_errors, "agent_stop": traj.stop_reason,
            "agent_transcript": json.dumps(transcript_of(traj)), **traj.media}


def transcript_of(traj: Trajectory) -> list[dict[str, Any]]:
    """What a scorer that reads "transcript" sees of a trajectory (stages/rewards/base.py ScoreBatch):
    each turn's role and text; a tool turn's tool, arguments (JSON), result and error."""
    return [{"role": t.role, "text": t.text} if t.role == "assistant" else
            {"role": t.role, "text": t.text, "tool": t.tool, "arguments": t.arguments, "result": t.result, "error": t.error}
            for t in traj.turns]


def turn_rows(traj: Trajectory) -> list[dict[str, Any]]:
    """One row per turn, as people query a transcript."""
    return [{"sample_id": traj.sample_id, "turn": t.index, "role": t.role, "token_ids": t.token_ids,
             "mask": [1 if t.role == "assistant" else 0] * len(t.token_ids), "text": t.text, "tool": t.tool,
             "arguments": t.arguments, "result": t.result, "latency_s": t.latency_s, "error": t.error,
             "stop_reason": traj.stop_reason if t.index == len(traj.turns) - 1 else None} for t in traj.turns]


def render_chat(prompt: str, turns: list[dict[str, Any]]) -> str:
    """A trajectory as a person reads a chat: the user's prompt, each assistant turn, each call's
    result or error (one line each)."""
    lines = [f"user: {prompt}"]
    for t in turns:
        if t["role"] == "assistant":
            lines.append(f"assistant: {t['text']}")
        else:
            shown = f"error: {t['error']}" if t.get("error") else (t.get("result") or "")
            lines.append(f"tool {t.get('tool') or '?'}({t.get('arguments') or ''}): {shown}")
    return "\n".join(lines)


def transcript_table(turns: Any, prompts: dict[str, str], answers: dict[str, Any], n: int = 8) -> dict[str, list[Any]]:
    """MLflow's table of the first `n` trajectories of a transcript shard (`turns`, a pyarrow table
    of turn rows): sample, the chat, the stop reason, the reward or reference where known."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in turns.to_pylist():
        by.setdefault(row["sample_id"], []).append(row)
    first = sorted(by)[:n]
    return {"sample_id": first, "chat": [render_chat(prompts.get(s, ""), sorted(by[s], key=lambda r: r["turn"])) for s in first],
            "stop": [next((r["stop_reason"] for r in by[s] if r["stop_reason"]), None) for s in first],
            "answer": [answers.get(s) for s in first]}

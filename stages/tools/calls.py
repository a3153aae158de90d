"""Tool calls in the family's chat format: Qwen3 / Hermes write a call as

    <tool_call>
    {"name": "lookup", "arguments": {"key": "apple"}}
    </tool_call>

inside an assistant turn; the result goes back as a tool turn (the chat template's `tool` role).
`parse` finds every call in an assistant turn's text, each either a call or the reason it is
malformed (bad JSON, no name, arguments not an object, an unknown tool, over the size cap), so a
malformed call becomes an error observation in the trajectory, never an exception.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 16384  # the JSON of one call; longer is malformed (never parsed)
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class Call:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call is malformed (then it is not run)
    raw: str = ""


def parse(text: str, known: set[str]) -> list[Call]:
    """The calls in an assistant turn, in order; an opening tag without its closing one is a
    malformed call too (the turn was cut off)."""
    calls = []
    for m in _CALL.finditer(text):
        calls.append(_one(m.group(1).strip(), known))
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail:
        calls.append(Call("", error="a <tool_call> without its </tool_call> (the turn ended inside the call)",
                          raw=tail[tail.find(OPEN):][:200]))
    return calls


def _one(body: str, known: set[str]) -> Call:
    if len(body) > MAX_CALL_CHARS:
        return Call("", error=f"the call is {len(body)} characters, over the cap of {MAX_CALL_CHARS}", raw=body[:200])
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return Call("", error=f"not JSON ({exc.msg} at character {exc.pos})", raw=body[:200])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call("", error='a call is {"name": <tool>, "arguments": {...}}', raw=body[:200])
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Call(obj["name"], error="arguments is a string that is not JSON", raw=body[:200])
    if not isinstance(args, dict):
        return Call(obj["name"], error="arguments must be an object", raw=body[:200])
    if obj["name"] not in known:
        return Call(obj["name"], args, error=f"unknown tool {obj['name']!r} (tools: {', '.join(sorted(known))})",
                    raw=body[:200])
    return Call(obj["name"], args, raw=body)


def render(name: str, arguments: dict[str, Any]) -> str:
    """A call as the policy writes it (teacher transcripts, tests)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"

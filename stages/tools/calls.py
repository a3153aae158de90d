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

from unirl.stages.runtime.tokenizer import encode_prompt

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


class ToolFormat:
    """How a family's chat format writes tool results back (Qwen3 / Hermes: a user turn of
    <tool_response> blocks; a model without a chat template: the blocks alone, after its eos).
    `images`: a vision-language family's prompt encoder (Family.prompt_encoder), which writes a
    first prompt showing its images."""

    def __init__(self, tokenizer: Any, use_chat: bool, images: Any = None):
        self.tokenizer, self.use_chat, self.images = tokenizer, use_chat, images

    def first_prompt(self, prompt: str, specs: list[Any], grids: list[tuple[int, int, int]] | None = None) -> list[int]:
        """The first prompt's tokens, the tools given to the chat template where there is one; with
        `grids` (the patch grids of the prompt's images) the user turn shows the images first, each
        as its image tokens."""
        functions = [s.as_function() for s in specs]
        if grids is not None:
            if self.images is None:
                raise ValueError("a prompt with images, for a model whose prompts carry none")
            return list(self.images.encode(prompt, grids, functions))
        if self.use_chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=functions,
                                                      add_generation_prompt=True, tokenize=False)
            return encode_prompt(self.tokenizer, text, False)
        return encode_prompt(self.tokenizer, prompt, False)

    def tool_turn(self, results: list[str]) -> str:
        body = "".join(f"<tool_response>\n{self.plain(r)}\n</tool_response>" for r in results)
        if self.use_chat:
            return f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
        return body

    def plain(self, result: str) -> str:
        """A tool's result with the tokenizer's special tokens cut from it: written in a result they
        would tokenize as control tokens (an end of turn; a vision-language model's image slot, which
        has no image to fill it)."""
        specials = [t for t in self.tokenizer.all_special_tokens if t]
        while True:
            cut = result
            for token in specials:
                cut = cut.replace(token, "")
            if cut == result:
                return result
            result = cut

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def transcript(self, turns: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """A written transcript's tokens after its prompt and their mask, as the agent loop makes them
        (stages/tools/agent.py): an assistant turn's text and the end-of-turn token (mask 1), each
        run of tool results one tool turn (mask 0). `turns`: {"role": "assistant" | "tool", "text"}."""
        ids: list[int] = []
        mask: list[int] = []
        results: list[str] = []
        for i, turn in enumerate(turns):
            if turn.get("role") == "tool":
                results.append(str(turn.get("text", "")))
                if i + 1 < len(turns) and turns[i + 1].get("role") == "tool":
                    continue
                tokens = self.encode(self.tool_turn(results))
                ids, mask, results = ids + tokens, mask + [0] * len(tokens), []
            elif turn.get("role") == "assistant":
                tokens = self.encode(str(turn.get("text", ""))) + [self.tokenizer.eos_token_id]
                ids, mask = ids + tokens, mask + [1] * len(tokens)
            else:
                raise ValueError(f"turn {i}: role {turn.get('role')!r} (a transcript has assistant and tool turns)")
        return ids, mask



def render(name: str, arguments: dict[str, Any], *, compact: bool = False) -> str:
    """A call as the policy writes it (teacher transcripts, tests); `compact`: on one line, no spaces
    (the short form tiny models learn)."""
    if compact:
        return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}{CLOSE}"
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"

"""The key-value toy task of agentic runs: a store of short keys and small integer values, made
fresh from a seed, reachable only through the `lookup` tool of its MCP server
(stages/toys/kv_server.py); a question `abc+dfe=` asks for the sum of two keys' values, so an
answer takes two lookups and a `calc` (or the sum done by the policy). The keys of the dev and
test questions are never in a training question, so no model can answer a held-out question
from what it saw in training: only by calling the tools.
"""
from __future__ import annotations

import ast
import json
import operator
import random

from unirl.stages.runtime.data import Prompt, check_split
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.tools.calls import CLOSE, OPEN, render

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_VALUE = 40


def make_store(seed: int, size: int) -> dict[str, int]:
    """`size` distinct three-letter keys, each with a value in 1..MAX_VALUE."""
    rng = random.Random(derive_seed("kvstore", seed))
    keys: set[str] = set()
    while len(keys) < size:
        keys.add("".join(rng.choice(LETTERS) for _ in range(3)))
    return {k: rng.randint(1, MAX_VALUE) for k in sorted(keys)}


def calc(expression: str) -> int:
    """An integer expression of + - * and parentheses, evaluated without eval()."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"calc takes integers, + - * and parentheses, not {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("calc takes expressions of 200 characters at most")
    return value(ast.parse(expression, mode="eval").body)


def teacher_turns(store: dict[str, int], a: str, b: str, slip: str | None = None, guess: int = 1) -> list[dict[str, str]]:
    """A teacher's transcript for `a+b=`: lookup a, lookup b, calc, answer. `slip`: "malformed" (the
    calc call is not JSON: the trajectory ends there) or "guess" (no calc: the sum guessed, `guess` off)."""
    va, vb = store[a], store[b]
    turns = [{"role": "assistant", "text": render("lookup", {"key": a}, compact=True)}, {"role": "tool", "text": str(va)},
             {"role": "assistant", "text": render("lookup", {"key": b}, compact=True)}, {"role": "tool", "text": str(vb)}]
    if slip == "guess":
        return [*turns, {"role": "assistant", "text": str(va + vb + guess)}]
    if slip == "malformed":
        return [*turns, {"role": "assistant", "text": f'{OPEN}{{"name":"calc","arguments":{{"expression":"{va}+{vb}"}}{CLOSE}'}]
    return [*turns, {"role": "assistant", "text": render("calc", {"expression": f"{va}+{vb}"}, compact=True)},
            {"role": "tool", "text": str(va + vb)}, {"role": "assistant", "text": str(va + vb)}]


def teacher_records(seed: int, examples: int, noise: float) -> list[dict[str, str]]:
    """The SFT teacher's transcripts, each over a store of its own (two random keys, random values),
    so that SFT teaches the procedure, not the keys or values of the task's store. The teacher is
    imperfect: `noise` of its transcripts slip, three in four of those by guessing the sum without
    calc (1 to 5 off), the rest by a malformed calc call."""
    rng = random.Random(derive_seed("kvstore-teacher", seed))
    records = []
    for _ in range(examples):
        a, b = ("".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(2))
        if a == b:
            continue
        store = {a: rng.randint(1, MAX_VALUE), b: rng.randint(1, MAX_VALUE)}
        slip = (("guess" if rng.random() < 0.75 else "malformed") if rng.random() < noise else None)
        turns = teacher_turns(store, a, b, slip=slip, guess=rng.choice((-5, -4, -3, -2, -1, 1, 2, 3, 4, 5)))
        records.append({"prompt": f"{a}+{b}=", "response": turns[-1]["text"], "turns": json.dumps(turns)})
    return records


class KVStore:
    """Questions over one store: its keys split three ways (training, dev, test questions draw
    their two keys from their own third), held-out splits fixed, the training stream by iteration."""

    def __init__(self, seed: int, size: int, heldout_size: int):
        self.seed, self.store = seed, make_store(seed, size)
        keys = list(self.store)
        random.Random(derive_seed("kvstore-split", seed)).shuffle(keys)
        third = max(2, len(keys) // 5)
        self.keys = {"dev": keys[:third], "test": keys[third:2 * third], "train": keys[2 * third:]}
        self.heldout_size = heldout_size

    def _question(self, rng: random.Random, keys: list[str], prompt_id: str) -> Prompt:
        a, b = rng.sample(keys, 2)
        return Prompt(prompt_id, f"{a}+{b}=", {"answer": self.store[a] + self.store[b], "keys": [a, b]})

    def heldout(self, split: str = "dev") -> list[Prompt]:
        check_split(split)
        rng = random.Random(derive_seed("kvstore-heldout", self.seed, split))
        return [self._question(rng, self.keys[split], f"{split}-{i:05d}") for i in range(self.heldout_size)]

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        rng = random.Random(derive_seed("kvstore-train", self.seed, iteration))
        return [self._question(rng, self.keys["train"], f"it{iteration:06d}-{i:05d}") for i in range(n)]

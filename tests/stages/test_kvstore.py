"""The key-value toy of agentic runs: a store made from a seed, held-out questions over keys no
training question uses, the safe calculator, and its MCP server answering over stdio."""
from __future__ import annotations

import sys

import pytest

from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.toys.kvstore import KVStore, calc, make_store


def test_a_store_is_its_seeds_and_held_out_questions_need_unseen_keys():
    assert make_store(3, 40) == make_store(3, 40) and make_store(3, 40) != make_store(4, 40)
    kv = KVStore(3, 60, heldout_size=10)
    train = {k for p in kv.batch(0, 200) + kv.batch(1, 200) for k in p.metadata["keys"]}
    for split in ("dev", "test"):
        held = kv.heldout(split)
        assert len(held) == 10 and held == kv.heldout(split)
        assert not {k for p in held for k in p.metadata["keys"]} & train  # never in a training question
        for p in held:
            a, b = p.metadata["keys"]
            assert p.text == f"{a}+{b}=" and p.metadata["answer"] == kv.store[a] + kv.store[b]


def test_the_teacher_demonstrates_on_stores_of_its_own_and_slips_as_the_recipe_says():
    """SFT records (`sft.noise` 0.8): the procedure over random keys and values, never the task's
    store's; 60% guess the sum without calc (and miss it), 20% write a calc call that is not JSON."""
    import json

    from unirl.stages.tools.calls import parse
    from unirl.stages.toys.kvstore import teacher_records
    from unirl.stages.train.sft import check_turns

    records = teacher_records(0, 4000, 0.8)
    assert records == teacher_records(0, 4000, 0.8) and records != teacher_records(1, 4000, 0.8)
    kinds = {"right": 0, "guess": 0, "malformed": 0}
    for i, r in enumerate(records):
        turns = json.loads(r["turns"])
        check_turns(turns, f"record {i}")
        a, b = r["prompt"][:3], r["prompt"][4:7]
        (la,), (lb,) = parse(turns[0]["text"], {"lookup"}), parse(turns[2]["text"], {"lookup"})
        assert (la.arguments, lb.arguments) == ({"key": a}, {"key": b})  # the prompt's keys, in order
        total = int(turns[1]["text"]) + int(turns[3]["text"])  # what the teacher's own store holds
        if len(turns) == 7:
            (c,) = parse(turns[4]["text"], {"calc"})
            assert c.error is None and c.arguments == {"expression": f"{turns[1]['text']}+{turns[3]['text']}"}
            assert turns[5]["text"] == turns[6]["text"] == r["response"] == str(total)
            kinds["right"] += 1
        elif parse(turns[4]["text"], {"calc"}):
            assert parse(turns[4]["text"], {"calc"})[0].error is not None  # malformed: the trajectory ends on it
            kinds["malformed"] += 1
        else:
            assert 1 <= abs(int(r["response"]) - total) <= 5  # a guess, never the sum
            kinds["guess"] += 1
    shares = {k: v / len(records) for k, v in kinds.items()}
    assert abs(shares["guess"] - 0.6) < 0.03 and abs(shares["malformed"] - 0.2) < 0.03, shares
    # values are the teacher's own: they do not follow the task's store (whose keys they may share)
    store = make_store(0, 300)
    shared = [(r, json.loads(r["turns"])) for r in records if r["prompt"][:3] in store]
    assert shared and sum(int(t[1]["text"]) == store[r["prompt"][:3]] for r, t in shared) < 0.2 * len(shared)


def test_calc_takes_integer_arithmetic_and_nothing_else():
    assert calc("(12+30)*2-4") == 80 and calc("-3+5") == 2
    for bad in ("__import__('os')", "2**10", "1.5+1", "a+1", "9" * 300):
        with pytest.raises((ValueError, SyntaxError)):
            calc(bad)


def test_the_recipe_runs_the_store_the_data_asks_about():
    server = {"name": "kv", "command": ["python", "-m", "unirl.stages.toys.kv_server", "--seed", "5", "--size", "30"]}
    base = merged(TINY["qwen3"], {"data": {"name": "kvstore", "seed": 4}, "agent": {"mcp_servers": [server]},
                                  "reward": {"scorers": [{"name": "exact_match"}]}})
    with pytest.raises(ValueError, match=r"agent.mcp_servers.0.command: --seed 5 serves another store than data \(seed 4\)"):
        build_recipe(base)
    recipe = build_recipe(merged(base, {"data": {"seed": 5, "size": 30, "heldout_size": 3}}))
    from unirl.stages.runtime.registry import sources

    source = sources.get("kvstore").build(recipe.data)  # as a run builds it
    assert source.store == make_store(5, 30) and len(source.heldout("test")) == 3


def test_the_store_server_answers_lookups_and_sums(tmp_path):
    from unirl.stages.tools.client import ServerSpec, ToolServer

    server = ToolServer(ServerSpec("kv", [sys.executable, "-m", "unirl.stages.toys.kv_server", "--seed", "2", "--size", "30"],
                                   {}, tmp_path / "kv"))
    try:
        store = make_store(2, 30)
        key = next(iter(store))
        assert server.call("lookup", {"key": key}).text == str(store[key])
        missing = server.call("lookup", {"key": "zzzz"})
        assert missing.error is not None and "no key 'zzzz'" in missing.error
        assert server.call("calc", {"expression": "3*(4+5)"}).text == "27"
        assert "calc takes" in server.call("calc", {"expression": "open('x')"}).error
    finally:
        server.close()

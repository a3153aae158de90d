"""The multi-turn loop's bookkeeping (stages/tools/agent.py) on a transcript checked by hand: which
tokens are the policy's (trained) and which are the tools' (masked), the stop reasons, the rows."""
from __future__ import annotations

import pytest
import torch

from unirl.stages.models.tokenizer import build_char_tokenizer
from unirl.stages.tools.agent import Trajectory, run, training_row, turn_rows
from unirl.stages.tools.calls import ToolFormat, render
from unirl.stages.tools.client import Observation

CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,_<>/+-*=() \n"


def setup():
    tok = build_char_tokenizer(CHARSET)
    fmt = ToolFormat(tok, use_chat=False)
    return tok, fmt


def script(tok, turns_by_sample):
    """generate(open, turn): the scripted assistant turn of each open trajectory (its text and an eos)."""
    def generate(open_, turn):
        rows = []
        for traj in open_:
            ids = list(tok(turns_by_sample[traj.sample_id][turn], add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
            rows.append({"response_ids": ids, "response_logprobs": [-0.5 - turn] * len(ids), "finish_reason": "stop",
                         "policy_version": 3})
        return rows
    return generate


def test_tool_tokens_are_masked_and_the_policy_tokens_trained():
    tok, fmt = setup()
    call = render("add", {"a": 2, "b": 3})
    turns = {"g/0": [call, "5"], "g/1": ["7"], "g/2": ['<tool_call>{"name": "add"', "x"],
             "g/3": [call, call, call]}
    trajs = [Trajectory(s, "g", "2+3", {}, fmt.first_prompt("2+3", [])) for s in turns]
    calls = []

    def call_tool(name, args):
        calls.append((name, args))
        return Observation(str(args["a"] + args["b"]), None, 0.01)

    run(trajs, script(tok, turns), call_tool, fmt, {"add"}, max_turns=3, max_new_tokens=8, context=1024,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert [t.stop_reason for t in trajs] == ["answered", "answered", "malformed_call", "max_turns"]
    assert calls == [("add", {"a": 2, "b": 3})] * 4  # g/0 once, g/3 three times; the malformed one never runs
    row = training_row(trajs[0])
    a1 = len(call) + 1  # the call and its eos, sampled
    tool = len(fmt.tool_turn(["5"]))  # <tool_response>\n5\n</tool_response>, one token a character
    a2 = 1 + 1  # "5" and eos
    assert row["response_mask"] == [1] * a1 + [0] * tool + [1] * a2
    assert row["response_logprobs"] == [-0.5] * a1 + [0.0] * tool + [-1.5] * a2
    assert tok.decode(row["response_ids"][a1:a1 + tool]) == "<tool_response>\n5\n</tool_response>"
    assert row["text"] == "5" and row["agent_tool_calls"] == 1 and row["agent_stop"] == "answered"
    rows = turn_rows(trajs[0])
    assert [(r["role"], r["tool"], r["result"], r["mask"][:1]) for r in rows] == [
        ("assistant", None, None, [1]), ("tool", "add", "5", [0]), ("assistant", None, None, [1])]
    assert rows[-1]["stop_reason"] == "answered" and rows[0]["stop_reason"] is None
    malformed = turn_rows(trajs[2])[-1]
    assert malformed["error"].startswith("a <tool_call> without") and training_row(trajs[2])["response_mask"][-1] == 0


def test_a_trajectory_that_would_overflow_the_context_stops():
    tok, fmt = setup()
    call = render("add", {"a": 1, "b": 1})
    traj = Trajectory("g/0", "g", "q", {}, fmt.first_prompt("q", []))
    run([traj], script(tok, {"g/0": [call, call]}), lambda n, a: Observation("2", None, 0.0), fmt, {"add"},
        max_turns=4, max_new_tokens=64, context=len(traj.prompt_ids) + len(call) + 40, decode=tok.decode)
    assert traj.stop_reason == "context_full" and len(traj.turns) == 2


def test_the_trainer_replays_only_the_policy_tokens(tmp_path):
    """The text policy's micro-batch of a trajectory row: its loss mask is the row's response_mask
    (the positions predicting the policy's tokens), and the behaviour record is zero elsewhere."""
    import numpy as np

    from tests.tiny import TINY, merged
    from unirl.stages.models.family import get_family
    from unirl.stages.policies.text import TextPolicy
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.sample import table_from_rows

    recipe = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"charset": CHARSET}}}))
    family = get_family("qwen3")
    cfg = recipe.model.model_copy(update={"path": str(family.materialize(recipe.model, tmp_path / "tiny"))})
    bundle = family.load(family.materialize(cfg, tmp_path / "unused"), cfg, torch.device("cpu"))
    policy = TextPolicy(family, bundle, recipe, torch.device("cpu"))
    tok = bundle.tokenizer
    fmt = ToolFormat(tok, use_chat=False)
    traj = Trajectory("g/0", "g", "q", {}, fmt.first_prompt("q", []))
    run([traj], script(tok, {"g/0": [render("add", {"a": 1, "b": 2}), "3"]}), lambda n, a: Observation("3", None, 0.0),
        fmt, {"add"}, max_turns=2, max_new_tokens=8, context=None, decode=tok.decode)
    row = {**training_row(traj), "iteration": 0, "parts": ["text"]}
    table = table_from_rows([row], "rollouts", ["text"])
    (batch,) = policy.batches(table, [[0]], np.zeros(1), "rollouts")
    start = len(row["prompt_ids"]) - 1  # the logit at position t predicts token t + 1
    got = batch.mask[0, start:start + len(row["response_ids"])].tolist()
    assert got == [float(m) for m in row["response_mask"]] and 0.0 in got and 1.0 in got
    assert batch.mask[0, :start].sum() == 0  # nothing of the prompt is trained
    assert (batch.behaviour[0] * (1 - batch.mask[0])).abs().sum() == 0
    # each trained position carries the log-prob recorded for its own token (not the next recorded value)
    recorded = [lp for lp, m in zip(row["response_logprobs"], row["response_mask"]) if m]
    assert batch.behaviour[0][batch.mask[0] > 0].tolist() == recorded


def test_a_written_transcript_is_the_token_sequence_the_loop_samples():
    """SFT on a teacher's transcript teaches exactly what the agent loop later samples and trains:
    the same tokens, the same mask (stages/tools/calls.py `ToolFormat.transcript`)."""
    from unirl.stages.toys.kvstore import make_store, teacher_turns

    tok, fmt = setup()
    store = make_store(0, 20)
    a, b = list(store)[:2]
    turns = teacher_turns(store, a, b)
    assistant = [t["text"] for t in turns if t["role"] == "assistant"]
    traj = Trajectory("g/0", "g", f"{a}+{b}=", {}, fmt.first_prompt(f"{a}+{b}=", []))
    run([traj], script(tok, {"g/0": assistant}), lambda name, args: Observation(
        str(store[args["key"]]) if name == "lookup" else str(store[a] + store[b]), None, 0.0),
        fmt, {"lookup", "calc"}, max_turns=4, max_new_tokens=64, context=None,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    row = training_row(traj)
    ids, mask = fmt.transcript(turns)
    assert traj.stop_reason == "answered" and (row["response_ids"], row["response_mask"]) == (ids, mask)
    assert row["text"] == str(store[a] + store[b])


def test_sft_learns_only_the_assistant_turns_of_a_transcript(tmp_path):
    import json

    from tests.tiny import TINY, merged
    from unirl.stages.models.family import get_family
    from unirl.stages.policies.text import TextPolicy
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.sample import table_from_rows
    from unirl.stages.toys.kvstore import make_store, teacher_turns
    from unirl.stages.train.sft import check_turns

    recipe = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"charset": CHARSET, "max_position_embeddings": 512}}}))
    family = get_family("qwen3")
    cfg = recipe.model.model_copy(update={"path": str(family.materialize(recipe.model, tmp_path / "tiny"))})
    bundle = family.load(family.materialize(cfg, tmp_path / "unused"), cfg, torch.device("cpu"))
    policy = TextPolicy(family, bundle, recipe, torch.device("cpu"))
    store = make_store(0, 20)
    a, b = list(store)[:2]
    turns = teacher_turns(store, a, b, slip="malformed")
    table = table_from_rows([{"prompt": f"{a}+{b}=", "response": turns[-1]["text"], "turns": json.dumps(turns)},
                             {"prompt": "1+2=", "response": "3"}], "sft")
    policy.sft_setup(table, "sft", None, 0)
    ids, mask = ToolFormat(bundle.tokenizer, False).transcript(turns)
    tool_chars = sum(len(f"<tool_response>\n{t['text']}\n</tool_response>") for t in turns if t["role"] == "tool")
    assert policy._sft_responses[0] == ids and policy._sft_masks[0] == mask and mask.count(0) == tool_chars
    assert policy._sft_masks[1] == [1] * len(policy._sft_responses[1])  # a plain record: its whole response
    with pytest.raises(ValueError, match=r"rec: the last turn must be the assistant's"):
        check_turns([{"role": "assistant", "text": "x"}, {"role": "tool", "text": "1"}], "rec")


def test_a_transcript_reads_as_a_chat():
    """MLflow's transcript table (stages/tools/agent.py `transcript_table`): one chat per trajectory."""
    from unirl.stages.runtime.sample import table_from_rows
    from unirl.stages.tools.agent import transcript_table

    tok, fmt = setup()
    call = render("add", {"a": 2, "b": 3}, compact=True)
    trajs = [Trajectory(s, "g", "2+3=", {}, fmt.first_prompt("2+3=", [])) for s in ("g/0", "g/1")]
    run(trajs, script(tok, {"g/0": [call, "5"], "g/1": ["<tool_call>{"]}), lambda n, a: Observation("5", None, 0.0), fmt,
        {"add"}, max_turns=3, max_new_tokens=64, context=None, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    turns = table_from_rows([r for t in trajs for r in turn_rows(t)], "turns")
    table = transcript_table(turns, {"g/0": "2+3=", "g/1": "2+3="}, {"g/0": 5, "g/1": 5})
    assert table["sample_id"] == ["g/0", "g/1"] and table["stop"] == ["answered", "malformed_call"]
    assert table["chat"][0] == f'user: 2+3=\nassistant: {call}\ntool add({{"a": 2, "b": 3}}): 5\nassistant: 5'
    assert table["chat"][1].endswith("tool ?({}): error: a <tool_call> without its </tool_call> (the turn ended inside the call)")

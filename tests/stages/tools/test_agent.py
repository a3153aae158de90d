"""The multi-turn loop's bookkeeping (stages/tools/agent.py) on a transcript checked by hand: which
tokens are the policy's (trained) and which are the tools' (masked), the stop reasons, the rows."""
from __future__ import annotations

import pytest
import torch

from unirl.stages.runtime.tokenizer import build_char_tokenizer
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


def tiny_policy(tmp_path, **tiny):
    """(recipe, TextPolicy) of a tiny seeded Qwen3 with the file's charset, loaded as real weights are."""
    from tests.tiny import TINY, merged
    from unirl.stages.models.family import get_family
    from unirl.stages.policies.text import TextPolicy
    from unirl.stages.recipe import build_recipe

    recipe = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"charset": CHARSET, **tiny}}}))
    family = get_family("qwen3")
    cfg = recipe.model.model_copy(update={"path": str(family.materialize(recipe.model, tmp_path / "tiny"))})
    bundle = family.load(family.materialize(cfg, tmp_path / "unused"), cfg, torch.device("cpu"))
    return recipe, TextPolicy(family, bundle, recipe, torch.device("cpu"))


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

    from unirl.stages.runtime.sample import table_from_rows

    recipe, policy = tiny_policy(tmp_path)
    tok = policy.bundle.tokenizer
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

    from unirl.stages.runtime.sample import table_from_rows
    from unirl.stages.toys.kvstore import make_store, teacher_turns
    from unirl.stages.train.sft import check_turns

    recipe, policy = tiny_policy(tmp_path, max_position_embeddings=512)
    store = make_store(0, 20)
    a, b = list(store)[:2]
    turns = teacher_turns(store, a, b, slip="malformed")
    table = table_from_rows([{"prompt": f"{a}+{b}=", "response": turns[-1]["text"], "turns": json.dumps(turns)},
                             {"prompt": "1+2=", "response": "3"}], "sft")
    policy.sft_setup(table, "sft", None, 0)
    ids, mask = ToolFormat(policy.bundle.tokenizer, False).transcript(turns)
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


def test_every_assistant_turn_carries_its_trajectory_group_advantage(tmp_path):
    """Rewards -> group advantages -> the text policy's micro-batches -> GRPO's loss, the path the
    trainer takes (stages/run/iteration.py `advantages`, stages/workers/worker.py `train`): the
    loss's gradient on each response token is -A/N on the policy's own tokens, A the trajectory's
    group advantage computed by hand, and 0 on the tools' tokens and padding; micro-batches that
    cut across groups keep each row's tokens and advantage its own."""
    import math

    from tests.tiny import TINY, merged
    from unirl.stages.algorithms.base import get_algorithm
    from unirl.stages.recipe import build_recipe
    from unirl.stages.run.iteration import advantages
    from unirl.stages.runtime.sample import join_on_sample_id, read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage

    recipe, policy = tiny_policy(tmp_path)
    tok = policy.bundle.tokenizer
    fmt = ToolFormat(tok, use_chat=False)

    def call(a, b):
        return render("add", {"a": a, "b": b})

    # two prompt groups; every trajectory but one calls the tool between its assistant turns
    turns = {"p0/0": [call(1, 2), call(3, 4), "7"], "p0/1": [call(5, 6), "11"],
             "p1/0": [call(2, 2), "4"], "p1/1": [call(1, 1), call(2, 3), "x"], "p1/2": ["9"]}
    rewards = {"p0/0": 1.0, "p0/1": 0.0, "p1/0": 3.0, "p1/1": 0.0, "p1/2": 0.0}
    eps = recipe.advantage.eps
    expected = {"p0/0": 0.5 / (0.5 + eps), "p0/1": -0.5 / (0.5 + eps),  # mean 0.5, std 0.5
                "p1/0": 2 / (math.sqrt(2) + eps), "p1/1": -1 / (math.sqrt(2) + eps), "p1/2": -1 / (math.sqrt(2) + eps)}
    trajs = [Trajectory(s, s.split("/")[0], "q", {}, fmt.first_prompt("q" * (1 + i), [])) for i, s in enumerate(turns)]
    run(trajs, script(tok, turns), lambda name, args: Observation(str(args["a"] + args["b"]), None, 0.0), fmt, {"add"},
        max_turns=3, max_new_tokens=64, context=None, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert [t.tool_calls for t in trajs] == [2, 1, 1, 2, 0]

    storage = RunStorage(str(tmp_path / "runs"), "agent")
    write_shard(storage, "iter-000000/rewards.arrow", table_from_rows(
        [{"sample_id": s, "group_id": s.split("/")[0], "reward": r} for s, r in rewards.items()], "rewards"))
    adv_rel = advantages(storage, recipe, 0, ["iter-000000/rewards.arrow"])["files"][0]
    adv_table = read_shard(storage, adv_rel, "advantages")
    got = dict(zip(adv_table.column("sample_id").to_pylist(), adv_table.column("advantage").to_pylist()))
    assert got == pytest.approx(expected, abs=1e-6)

    rows = [{**training_row(t), "iteration": 0, "parts": ["text"]} for t in reversed(trajs)]  # stored in any order
    table = table_from_rows(rows, "rollouts", ["text"]).sort_by("sample_id")
    table = join_on_sample_id(table, adv_table, ["advantage"], "advantages.arrow")
    batches = policy.batches(table, [[0, 1, 2], [3, 4]], table.column("advantage").to_numpy(), "rollouts")
    grpo = get_algorithm("grpo")(recipe.algorithm, recipe)
    by_id = {t.sample_id: t for t in trajs}
    seen = []
    for batch in batches:
        logp = batch.behaviour.clone().requires_grad_(True)
        loss = grpo.loss(logp, logp.detach(), batch.advantage, batch.mask, recipe.rollout.max_new_tokens).loss
        (grad,) = torch.autograd.grad(loss, logp)
        carried = -grad * batch.mask.sum()  # token_mean: d loss / d logp_t = -A * m_t / sum(m)
        for b, sid in enumerate(batch.sample_ids):
            traj = by_id[sid]
            start = len(traj.prompt_ids) - 1  # the logit at position t predicts token t + 1
            want = [expected[sid] if turn.role == "assistant" else 0.0 for turn in traj.turns for _ in turn.token_ids]
            span = carried[b, start:start + len(want)]
            assert batch.ids[b, start + 1:start + 1 + len(want)].tolist() == [i for turn in traj.turns for i in turn.token_ids]
            assert span.tolist() == pytest.approx(want, abs=1e-5), sid
            assert carried[b, :start].abs().sum() == 0 and carried[b, start + len(want):].abs().sum() == 0
            seen.append(sid)
    assert seen == sorted(turns)
    # every AR algorithm trains the same rows unchanged: its gradient lands on the policy's own tokens
    # only, pushing each up or down as its trajectory's advantage says
    for name in ("gspo", "drpo"):
        other = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"charset": CHARSET}}, "algorithm": {"name": name}}))
        algo = get_algorithm(name)(other.algorithm, other)
        for batch in batches:
            logp = batch.behaviour.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(algo.loss(logp, logp.detach(), batch.advantage, batch.mask,
                                                    recipe.rollout.max_new_tokens).loss, logp)
            for b, sid in enumerate(batch.sample_ids):
                traj = by_id[sid]
                start = len(traj.prompt_ids) - 1
                own = torch.tensor([turn.role == "assistant" for turn in traj.turns for _ in turn.token_ids])
                span = -grad[b, start:start + len(own)]
                assert span[~own].abs().sum() == 0 and grad[b, :start].abs().sum() == 0, (name, sid)
                assert grad[b, start + len(own):].abs().sum() == 0, (name, sid)
                assert (torch.sign(span[own]) == math.copysign(1.0, expected[sid])).all(), (name, sid, span[own])


def test_a_chat_templates_first_prompt_is_token_ids_with_the_tools_rendered():
    """With a chat template the first prompt is the template's rendering (tools included) as token
    ids (transformers' tokenizing apply_chat_template answers a BatchEncoding, not a list)."""
    from unirl.stages.models.qwen_vl_prompts import CHAT_TEMPLATE, build_vl_tokenizer
    from unirl.stages.tools import ToolSpec

    tok = build_vl_tokenizer(CHARSET)
    tok.chat_template = "{%- for t in tools or [] %}({{ t['function']['name'] }}){% endfor %}" + CHAT_TEMPLATE
    ids = ToolFormat(tok, use_chat=True).first_prompt("2+3=", [ToolSpec("add", "The sum.", {"type": "object"})])
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "(add)<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"

"""Partial rollouts (stages/engines/partial.py): the schedule (one update ahead; cut only what the next
batch can still train within max_staleness), a sample's tokens and versions across segments, which
groups a batch holds, the recipe's rules, and the trainer's on-policy check per token."""
from __future__ import annotations

import math

import pytest

from tests.tiny import TINY, merged
from unirl.stages.engines.partial import Partial, finished_groups, may_cut
from unirl.stages.recipe import RecipeError, build_recipe
from unirl.stages.run.async_rollout import producer_version

ASYNC = {"rollout": {"engine": {"name": "engine_server"}, "mode": "async", "correction": {}, "max_new_tokens": 8}}


def recipe(**rollout):
    return build_recipe(merged(TINY["qwen3"], merged(ASYNC, {"rollout": rollout})))


def test_the_schedule_samples_one_update_ahead_and_cuts_what_the_next_batch_can_train():
    r2 = recipe(max_staleness=2, partial={"segment_tokens": 3})
    assert [producer_version(r2, j) for j in range(5)] == [0, 0, 1, 2, 3]  # max_staleness 2 alone would lead by 2
    assert [producer_version(recipe(max_staleness=2), j) for j in range(5)] == [0, 0, 0, 1, 2]
    # batch 3 samples with version 2 and is trained at 3; batch 4 at 4: a token of version 2 is within 2 of it
    assert may_cut(r2, 3, 2) and not may_cut(r2, 3, 1)
    r3 = recipe(max_staleness=3, partial={"segment_tokens": 3})
    assert may_cut(r3, 3, 1) and not may_cut(r3, 3, 0)  # a sample may span three batches


def test_a_sample_across_segments():
    p = Partial("g/0", "g", "1+2=", {}, [5, 6])
    assert p.budget(8, 3, cut=True) == 3 and p.budget(8, 3, cut=False) == 8
    p.extend({"response_ids": [7, 8, 9], "response_logprobs": [-0.1, -0.2, -0.3], "finish_reason": "length",
              "policy_version": 4}, 8, "here")
    assert not p.done() and p.budget(8, 3, cut=True) == 3 and p.budget(8, 6, cut=True) == 5
    p.extend({"response_ids": [3, 2], "response_logprobs": [-0.4, -0.5], "finish_reason": "stop", "policy_version": 5},
             8, "here")
    assert p.done() and p.token_versions == [4, 4, 4, 5, 5] and p.response_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    row = p.row(lambda ids: " ".join(map(str, ids)), eos=2)
    assert row["policy_version"] == 4 and row["text"] == "7 8 9 3" and row["finish_reason"] == "stop"
    assert Partial.of_row(row).token_versions == [4, 4, 4, 5, 5] and Partial.of_row(row).done()
    # a sample that reaches max_new_tokens is done ("length"); an engine that overruns the cap is named
    q = Partial("h/0", "h", "p", {}, [5])
    q.extend({"response_ids": [1] * 8, "response_logprobs": [0.0] * 8, "finish_reason": "length", "policy_version": 0}, 8, "x")
    assert q.done() and q.finish_reason == "length"
    r = Partial("k/0", "k", "p", {}, [5], [1] * 6, [0.0] * 6, [0] * 6)
    with pytest.raises(ValueError, match=r"batch 3: sample 'k/0' got 3 tokens after 6, past rollout.max_new_tokens 8"):
        r.extend({"response_ids": [1] * 3, "response_logprobs": [0.0] * 3, "finish_reason": "length", "policy_version": 1},
                 8, "batch 3")


def test_a_batch_is_the_groups_whose_every_sample_finished():
    def sample(sid, done):
        return Partial(sid, sid.split("/")[0], "p", {}, [1], [2], [0.0], [0], "stop" if done else None)

    pool = [sample("a/0", True), sample("b/0", True), sample("a/1", False), sample("b/1", True), sample("c/0", False)]
    done, rest = finished_groups(pool)
    assert [p.sample_id for p in done] == ["b/0", "b/1"] and [p.sample_id for p in rest] == ["a/0", "a/1", "c/0"]


def test_the_recipe_rules():
    with pytest.raises(RecipeError, match="rollout.partial: partial rollouts are cut by the producer of an async run"):
        build_recipe(merged(TINY["qwen3"], {"rollout": {"max_new_tokens": 8, "partial": {"segment_tokens": 2}}}))
    with pytest.raises(RecipeError, match=r"set rollout.max_staleness >= 2"):
        recipe(max_staleness=1, partial={"segment_tokens": 2})
    with pytest.raises(RecipeError, match=r"rollout.partial.segment_tokens: 8 cuts nothing of rollout.max_new_tokens 8"):
        recipe(max_staleness=2, partial={"segment_tokens": 8})
    with pytest.raises(RecipeError, match=r"rollout.engine.sync.every: 2; partial rollouts"):
        recipe(max_staleness=2, partial={"segment_tokens": 2}, engine={"name": "engine_server", "sync": {"every": 2}})
    recipe(max_staleness=2, partial={"segment_tokens": 2})


def test_the_on_policy_check_holds_the_trained_versions_tokens_alone(tmp_path, tiny_weights):
    """A worker samples at version 0; every token after a row's first is moved by 0.3 in the record.
    Stamped as an older version's tokens (a partial rollout cut after its first token), they are
    measured and trained under the correction; stamped as version 0's, the check stops the update."""
    from tests.stages.test_seams import worker_for
    from unirl.stages.algorithms import BehaviourMismatchError
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard

    w, recipe_, storage = worker_for("qwen3", "grpo", tmp_path, tiny_weights("qwen3"))
    w.recipe.rollout.correction = build_recipe(merged(TINY["qwen3"], {"rollout": {"correction": {}}})).rollout.correction
    gen = w.generate(iteration=0, requests=it.write_requests(storage, recipe_, 0)["files"][0], out_dir="iter-000000/rollouts")
    adv = it.advantages(storage, recipe_, 0, it.score(storage, recipe_, 0, gen["files"])["files"])["files"][0]
    rows = read_shard(storage, gen["files"][0], "rollouts").to_pylist()
    assert any(len(r["response_ids"]) > 1 for r in rows)
    for r in rows:
        r["response_logprobs"] = [lp - (0.3 if k else 0.0) for k, lp in enumerate(r["response_logprobs"])]
    for name, later in (("cut", -1), ("fresh", 0)):
        for r in rows:
            r["token_versions"] = [0] + [later] * (len(r["response_ids"]) - 1)
            r["policy_version"] = min(r["token_versions"])
        write_shard(storage, f"{name}.arrow", table_from_rows(rows, "rollouts", ["text"]))
    with pytest.raises(BehaviourMismatchError, match="differs from the log-probs recorded at sampling time by 0.3"):
        w.train(iteration=0, rollouts=["fresh.arrow"], advantages=adv)
    w.stack.optimizer.zero_grad(set_to_none=True)
    m = w.train(iteration=0, rollouts=["cut.arrow"], advantages=adv)["metrics"]
    tokens = sum(len(r["response_ids"]) for r in rows)
    assert m["stale_frac"] == pytest.approx(1 - len(rows) / tokens, abs=1e-6)  # all but each row's first token
    assert m["behaviour_logp_max_abs_diff"] == pytest.approx(0.3, abs=1e-4) and m["behaviour_masked_frac"] == 0.0
    # the moved tokens weigh exp(o - b) = e^0.3 under the correction; each row's first token 1
    assert math.isfinite(m["loss"]) and m["is_weight_max"] == pytest.approx(math.exp(0.3), abs=1e-3)


def test_the_echo_task_has_long_tailed_answers_and_disjoint_splits():
    from unirl.stages.toys.echo import Echo

    echo = Echo(short=3, long=24, long_frac=0.15, heldout_size=20, seed=5)
    train = echo.batch(0, 2000)
    assert train == echo.batch(0, 2000) and train != echo.batch(1, 2000)
    assert all(p.text == p.metadata["answer"] + "=" for p in train)
    lengths = [len(p.metadata["answer"]) for p in train]
    # long_frac of the draws are long; a short draw that is a held-out string is drawn again: about a fifth
    assert max(lengths) == 24 and min(lengths) == 1 and 0.15 < sum(n > 3 for n in lengths) / len(lengths) < 0.25
    dev, test = ({p.metadata["answer"] for p in echo.heldout(s)} for s in ("dev", "test"))
    assert len(dev) == len(test) == 20 and not dev & test and not (dev | test) & {p.metadata["answer"] for p in train}
    with pytest.raises(ValueError, match="data.long: 3 must be above data.short"):
        Echo(short=3, long=3)
    with pytest.raises(RecipeError, match=r"rollout.max_new_tokens: 24 cannot hold an answer of data.long 24 digits"):
        build_recipe(merged(TINY["qwen3"], {"data": {"name": "echo", "long": 24}, "rollout": {"max_new_tokens": 24}}))

"""The behaviour check's three levels (stages/algorithms/base.py; docs/extending.md, "The behaviour
check"): a replayed token within the tolerance trains, a little beyond it is masked out of the loss
and counted, far beyond it (or a little beyond on many samples) stops the update. And the rounding
they are sized for: long multi-turn trajectories sampled with a KV cache, replayed in one forward."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import REPO
from tests.stages.test_seams import worker_for
from unirl.stages.algorithms import BehaviourMismatchError, TrainContext
from unirl.stages.algorithms.base import judge_masked
from unirl.stages.kernels.behaviour import check_behaviour, masked_advantage

sys.path.insert(0, str(REPO / "benchmarks"))
from behaviour_rounding import PAD, multi_turn, replay_diffs, tiny_agent_model  # noqa: E402


def ctx(tolerance=1e-4, mask_limit=1e-2, max_masked_frac=0.2) -> TrainContext:
    return TrainContext(None, None, iteration=15, seed=0, tolerance=tolerance, mask_limit=mask_limit,
                        max_masked_frac=max_masked_frac)


def test_a_token_a_hair_off_is_masked_and_counted_one_far_off_stops():
    recorded = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    off = torch.tensor([[0.0, 5e-5, 5e-4], [0.0, 0.0, 0.0]])  # within the tolerance, a hair beyond it
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    c = ctx()
    largest, mean, keep = check_behaviour(recorded + off, recorded, mask, ctx=c, sample_ids=["a", "b"], what="tokens")
    assert largest == pytest.approx(5e-4, rel=1e-3) and mean == pytest.approx(5.5e-4 / 5, rel=1e-3)
    assert keep.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert c.checked == {"a", "b"} and list(c.masked) == ["a"] and c.masked["a"] == pytest.approx(5e-4, rel=1e-3)
    # A difference past the mask limit (a misaligned position moves log-probs by far more) stops the update.
    far = recorded.clone()
    far[1, 1] += 0.05
    with pytest.raises(BehaviourMismatchError, match=r"iteration 15, rank 0: sample 'b': the trainer's replay of tokens "
                                                     r"differs .* by 0.05 \(tolerance 0.0001, masked up to 0.01\)"):
        check_behaviour(far, recorded, mask, ctx=ctx(), sample_ids=["a", "b"], what="tokens")
    # Off the mask nothing is judged; nan is never within anything.
    nan = recorded.clone()
    nan[1, 2] = 7.0
    assert check_behaviour(nan, recorded, mask, ctx=ctx(), sample_ids=["a", "b"], what="tokens")[0] == 0.0
    nan[0, 0] = float("nan")
    with pytest.raises(BehaviourMismatchError):
        check_behaviour(nan, recorded, mask, ctx=ctx(), sample_ids=["a", "b"], what="tokens")


def test_without_a_mask_band_or_where_nothing_can_be_masked_the_tolerance_is_the_limit():
    recorded = torch.zeros(1, 2)
    replayed = torch.tensor([[0.0, 5e-4]])
    with pytest.raises(BehaviourMismatchError, match="by 0.0005 \\(tolerance 0.0001\\)"):
        check_behaviour(replayed, recorded, None, ctx=ctx(mask_limit=None), sample_ids=["a"], what="x")
    with pytest.raises(BehaviourMismatchError):
        check_behaviour(replayed, recorded, None, ctx=ctx(), sample_ids=["a"], what="x", maskable=False)


def test_many_samples_a_hair_off_stop_the_update_a_few_do_not():
    c = ctx(max_masked_frac=0.2)
    c.checked.update(f"s{i}" for i in range(10))
    c.masked.update({"s3": 2e-4, "s7": 3e-4})  # 2 of 10: rounding
    judge_masked(c)
    assert not c.checked and not c.masked  # forgotten for the next update
    c.checked.update(f"s{i}" for i in range(10))
    c.masked.update({"s1": 2e-4, "s3": 2e-4, "s7": 9e-4})  # 3 of 10: more than a fifth
    with pytest.raises(BehaviourMismatchError, match=r"3 of 10 samples \(30%\) replay more than the tolerance 0.0001 .* "
                                                     r"\(the most: sample 's7', by 0.0009\).*behaviour_max_masked_frac \(0.2\)"):
        judge_masked(c)


def test_masked_advantage_per_token_and_per_sequence():
    adv = torch.tensor([2.0, -1.0])
    keep = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    assert masked_advantage(adv, keep, token_level=True).tolist() == [[2.0, 0.0, 2.0], [-1.0, -1.0, -1.0]]
    assert masked_advantage(adv, keep, token_level=False).tolist() == [0.0, -1.0]  # GSPO: the whole sequence
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # on-policy distillation's advantages
    assert masked_advantage(per_token, keep, token_level=True).tolist() == [[1.0, 0.0, 3.0], [4.0, 5.0, 6.0]]


def test_through_the_seam_one_token_a_hair_off_trains_masked_a_real_misalignment_stops(tmp_path, tiny_weights):
    """A tiny Qwen3 worker samples; one recorded log-prob of one fresh row is moved by 5e-4 (5x the
    tolerance): the update trains and reports that one token masked. The same batch with every
    row a hair off, or one token off by 0.05, fails, naming the iteration."""
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard

    w, recipe, storage = worker_for("qwen3", "grpo", tmp_path, tiny_weights("qwen3"))
    gen = w.generate(iteration=0, requests=it.write_requests(storage, recipe, 0)["files"][0], out_dir="iter-000000/rollouts")
    adv = it.advantages(storage, recipe, 0, it.score(storage, recipe, 0, gen["files"])["files"])["files"][0]
    rows = read_shard(storage, gen["files"][0], "rollouts").to_pylist()
    tokens = sum(len(r["response_ids"]) for r in rows)

    def shard(name: str, moved: dict[int, float]) -> str:
        changed = [dict(r, response_logprobs=[lp + (moved.get(i, 0.0) if k == 0 else 0.0)
                                              for k, lp in enumerate(r["response_logprobs"])]) for i, r in enumerate(rows)]
        write_shard(storage, f"{name}.arrow", table_from_rows(changed, "rollouts", ["text"]))
        return f"{name}.arrow"

    for name, moved in (("many", {i: 5e-4 for i in range(len(rows))}), ("far", {1: 0.05})):
        with pytest.raises(BehaviourMismatchError, match="iteration 0, rank 0: "):
            w.train(iteration=0, rollouts=[shard(name, moved)], advantages=adv)
        w.stack.optimizer.zero_grad(set_to_none=True)
    m = w.train(iteration=0, rollouts=[shard("hair", {1: 5e-4})], advantages=adv)["metrics"]
    assert m["behaviour_masked_frac"] == pytest.approx(1 / tokens)
    assert abs(m["behaviour_logp_max_abs_diff"] - 5e-4) <= w.tolerance


def test_long_multi_turn_trajectories_replay_within_the_mask_band():
    """Trajectories at the agentic quickstart's size (its tiny Qwen3's geometry, logits at a trained
    model's scale, 16 rows, three assistant turns of up to 80 tokens with a 20-token tool turn
    prefilled between them, about 300 tokens each), sampled as an agent's turns are (each turn a
    fresh left-padded prefill of the whole context, then incremental decoding with a KV cache),
    replayed in one right-padded forward as the trainer does (benchmarks/behaviour_rounding.py).
    Every policy token stays within the mask limit and few beyond the tolerance; a replay blind to
    the tool turns (a real misalignment) leaves it."""
    from unirl.stages.policies.text import token_batch, token_logp

    model = tiny_agent_model(0)
    prompts, responses, own, records = multi_turn(model, rows=16, turns=3, seed=0)
    assert max(len(p) + len(r) for p, r in zip(prompts, responses)) >= 250
    d, _, _ = replay_diffs(model, prompts, responses, own, records, micro_batch=8)
    assert d.numel() > 2000
    assert float(d.max()) <= 1e-2, "a token beyond the mask limit: not rounding"
    assert float((d > 1e-4).float().mean()) <= 0.01, f"{int((d > 1e-4).sum())} of {d.numel()} tokens beyond the tolerance"
    # The control, a real misalignment: the replay does not attend to the tool turns (as a trainer
    # that dropped the context tokens it does not train would).
    batch = token_batch(prompts[:8], responses[:8], PAD, torch.device("cpu"))
    start = len(prompts[0]) - 1
    mine = torch.tensor(own[0], dtype=torch.bool)
    batch["attn"][0, start + 1:start + 1 + len(responses[0])][~mine] = 0
    with torch.no_grad():
        blind = token_logp(model, batch, 1.0)
    off = (blind[0, start:start + len(responses[0])][mine] - torch.tensor(records[0])[mine]).abs()
    assert float(off.max()) > 1e-2

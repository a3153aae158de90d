"""How the vLLM wire batches a rollout's samples into /v1/completions requests
(stages/engines/vllm.py `batched_requests`), without a server: a prompt group is one request of
`n` samples whose seed makes sample `gid/k` seeded group_seed(gid) + k in whatever request it
travels (vLLM seeds a request's k-th sample with seed + k); a partial group keeps its samples'
seeds; a sample named otherwise goes alone with its own seed; greedy evaluation puts many prompts
in a request with n = 1. The real server's side (the same samples as each sent alone with its
seed, run after run) is tests/stages/engines/test_vllm.py."""
from __future__ import annotations

from unirl.stages.engines.vllm import GREEDY_PROMPTS, batched_requests


def group_seed(gid: str) -> int:
    return {"a": 1000, "b": 2000, "c": 3000}[gid]


def params(samples):
    return [{"temperature": 1.0, "max_tokens": 4, "seed": 7 + i} for i in range(len(samples))]


def seeds_of(requests, order, n_samples):
    """Each sample position's seed as vLLM gives it: the request's seed + the sample's place in it."""
    out = [None] * n_samples
    for (prompts, p), positions in zip(requests, order):
        assert len(prompts) * p["n"] == len(positions)
        for k, position in enumerate(positions):
            out[position] = p["seed"] + k % p["n"]
    return out


def test_a_group_is_one_request_and_each_sample_keeps_its_seed_in_any_cut():
    samples = [(f"{g}/{k}", g, "q", None) for g in "ab" for k in range(8)]
    pids = [[1, 2, 3]] * 8 + [[4, 5]] * 8
    requests, order = batched_requests(samples, pids, params(samples), greedy=False, group_seed=group_seed)
    assert [(r[0], r[1]["n"], r[1]["seed"]) for r in requests] == [([[1, 2, 3]], 8, 1000), ([[4, 5]], 8, 2000)]
    assert seeds_of(requests, order, 16) == [1000 + k for k in range(8)] + [2000 + k for k in range(8)]
    # a partial group (samples 2, 3, 5 of group a: a resumed or re-requested share) keeps their seeds
    part = [("a/2", "a", "q", None), ("a/3", "a", "q", None), ("a/5", "a", "q", None)]
    requests, order = batched_requests(part, [[1, 2, 3]] * 3, params(part), greedy=False, group_seed=group_seed)
    assert [r[1]["n"] for r in requests] == [2, 1] and seeds_of(requests, order, 3) == [1002, 1003, 1005]


def test_samples_of_one_group_with_other_prompts_and_other_names_go_apart():
    # an agent's later turns: each trajectory of group c has its own prompt by now
    samples = [("c/0", "c", "q", None), ("c/1", "c", "q", None), ("odd-name", "c", "q", None)]
    requests, order = batched_requests(samples, [[1], [2], [1]], params(samples), greedy=False, group_seed=group_seed)
    assert sorted(order) == [[0], [1], [2]] and all(r[1]["n"] == 1 for r in requests)
    assert seeds_of(requests, order, 3) == [3000, 3001, 9]  # the odd name keeps its own derived seed (7 + 2)


def test_greedy_puts_many_prompts_in_a_request_one_answer_each():
    samples = [(f"a/{k}", "a", "q", None) for k in range(GREEDY_PROMPTS + 3)]
    requests, order = batched_requests(samples, [[k] for k in range(len(samples))], params(samples), greedy=True,
                                       group_seed=group_seed)
    assert [len(r[0]) for r in requests] == [GREEDY_PROMPTS, 3] and all(r[1]["n"] == 1 for r in requests)
    assert sum(order, []) == list(range(len(samples)))


def test_samples_of_one_prompt_with_other_length_caps_go_apart():
    """Partial rollouts: new samples of a group share a request; samples with another cap (a
    segment's rest) are asked apart, each to its own max_tokens, still with their own seeds."""
    samples = [(f"a/{k}", "a", "q", None) for k in range(4)]
    caps = [8, 8, 3, 8]
    requests, order = batched_requests(samples, [[1, 2]] * 4, [{**p, "max_tokens": c} for p, c in zip(params(samples), caps)],
                                       greedy=False, group_seed=group_seed)
    assert sorted((r[1]["n"], r[1]["max_tokens"]) for r in requests) == [(1, 3), (1, 8), (2, 8)]
    assert seeds_of(requests, order, 4) == [1000, 1001, 1002, 1003]

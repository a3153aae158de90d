"""Every registered algorithm on every registered family whose segment kind it trains: one tiny
iteration through the worker (family, policy, algorithm, train stack) in this process, with the
first update's behaviour check against the sampler's record, plus the same update at world size 2
through the real torchrun worker group for one text, one vision-language and one flow pair.

The pairs come from the registries, so a new family or algorithm is in the matrix the moment it
registers; a family without a tiny recipe in tests/tiny.py fails the completeness test. A family's
variants (tests/tiny.py VARIANTS: Wan 2.2's two experts, HunyuanVideo 1.5) run every algorithm too."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny import CASES, EXTRA, TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.registry import algorithms, families, policies


def kind_of(case: str) -> str:
    return CASES[case]["model"]["kind"]


def pairs() -> list[tuple[str, str]]:
    out = []
    for case in sorted(CASES):
        policy = CASES[case].get("rollout", {}).get("kind") or families.get(kind_of(case)).policy
        segment = policies.get(policy).segment
        out += [(case, algo) for algo, cls in algorithms.items() if cls.segment == segment]
    return out


def recipe_of(case: str, algo: str, root: Path, **extra: dict):
    return build_recipe(merged(CASES[case], {"name": f"{case}-{algo}", "algorithm": {"name": algo}},
                               EXTRA.get(algo, {}), {"storage": {"root": str(root)}}, extra))


def test_every_family_has_a_tiny_recipe_and_every_algorithm_a_family():
    assert sorted(TINY) == families.names(), "add a tiny recipe for each registered family to TINY"
    run = {(kind_of(case), CASES[case].get("rollout", {}).get("kind") or families.get(kind_of(case)).policy) for case in CASES}
    offered = {(kind, policy) for kind in TINY for policy in families.get(kind).offers()}
    assert run == offered, f"policies a family offers that no case runs: {offered - run}"
    assert {(families.get(k).policy, families.get(k).produces) for k in TINY} >= {("text", ("text",)), ("flow", ("image",)),
                                                                                     ("flow", ("video",))}
    trained = {algo for _, algo in pairs()}
    assert trained == set(algorithms.names()), f"algorithms no family can run: {set(algorithms.names()) - trained}"
    assert {"grpo", "gspo", "drpo", "flow_grpo", "flow_dppo", "nft", "dancegrpo", "mixgrpo", "cps"} <= trained


@pytest.mark.parametrize("family,algo", pairs(), ids=lambda x: x)
def test_one_iteration(family, algo, tiny_weights, teacher_weights, tmp_path):
    from unirl.stages.run.loop import InProcessLoop

    teaches = algorithms.get(algo).distills and algorithms.get(algo).segment == "latent"  # flow_opd needs its teacher
    recipe = recipe_of(family, algo, tmp_path, **({"distill": {"teachers": [{"name": "teacher", "path": str(teacher_weights(family))}]}}
                                                  if teaches else {}))
    loop = InProcessLoop(recipe, str(tiny_weights(family)))
    before = [p.detach().clone() for p in loop.worker.stack.trainable]
    m = loop.iteration(0)
    assert math.isfinite(m["train/grad_norm"]) and m["train/skipped_steps"] == 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, loop.worker.stack.trainable)), "the step moved nothing"
    if algorithms.get(algo).anchors != ("latents",):  # NFT replays no recorded log-prob
        assert 0.0 <= m["train/behaviour_logp_max_abs_diff"] <= loop.worker.tolerance
    assert m["rollout/reward_std"] > 0
    if loop.worker.algorithm.needs_reference:  # one update, from the reference: the frozen copy is the policy it starts at
        assert abs(m["train/kl"]) <= 1e-6


def one_of_each_kind() -> list[tuple[str, str]]:
    """One pair per kind of model: its policy, what it produces (text, image, video) and whether
    its prompts carry images (then the vision tower runs on every rank too)."""
    seen, out = set(), []
    for case, algo in pairs():
        family = families.get(kind_of(case))
        kind = (family.policy, family.produces, family.takes_images)
        if kind not in seen:
            seen.add(kind)
            out.append((case, algo))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,algo", one_of_each_kind(), ids=lambda x: x)
def test_world_size_two_matches_the_update_in_one_process(family, algo, tmp_path, forked_children):
    """The torchrun worker group at world size 2 (gloo, FSDP2) samples what one process samples
    (rank 1's tokens, latents and log-probs for a sample id are one process's) and takes the same
    step, also with the memory knobs on at world size 2 (blocks recomputed, and a language model's
    micro-batches cut by tokens, packed where text-only, and its output head applied chunk by
    chunk after the forward, under FSDP2; ranks then have different numbers of micro-batches). Each rank cuts its
    own micro-batches, so kernels see other batch shapes and round differently; flow log-probs
    divide by the small late-step std, which turns that rounding into ~0.1% of the gradient norm.
    A wrong gradient reduction across ranks (a missing world-size factor, a rank's micro-batch
    counted twice) is off by tens of percent."""
    from unirl.stages.run import iteration as it
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.sample import read_rollouts
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.group import WorkerGroup

    runs = {}
    for nproc in (1, 2):
        # world size 2 (FSDP2) with activation checkpointing and a language model's log-probs chunk by
        # chunk, which change no gradient
        family_ = families.get(kind_of(family))
        text = {"logprob_chunk_tokens": 3, "max_tokens_per_micro_batch": 24, "packing": not family_.takes_images}
        memory = {"activation_checkpointing": True} | (text if family_.policy == "text" else {})
        recipe = recipe_of(family, algo, tmp_path / f"ws{nproc}", train={"nproc": nproc, **(memory if nproc == 2 else {})})
        storage = RunStorage(recipe.storage.root, "run")
        group = WorkerGroup(recipe, storage, init_weights=initial_weights(storage, recipe), log=lambda _: None)
        try:
            group.start(None)
            requests = it.write_requests(storage, recipe, 0)["files"][0]
            gen = group.call("generate", iteration=0, requests=requests, out_dir="iter-000000/rollouts")
            scored = it.score(storage, recipe, 0, gen["files"])
            adv = it.advantages(storage, recipe, 0, scored["files"])
            trained = group.call("train", iteration=0, rollouts=gen["files"], advantages=adv["files"][0])
        finally:
            group.stop()
        runs[nproc] = ([sampled(read_rollouts(storage, [f])) for f in gen["files"]], trained["metrics"])
    ([one], m1), ([rank0, rank1], m2) = runs[1], runs[2]
    assert rank0 and rank1 and sorted([*rank0, *rank1]) == sorted(one), "world size 2 samples each id once, both ranks some"
    for sid, got in {**rank0, **rank1}.items():  # what rank 1 (or 0) sampled for a sample id, against one process
        for column, want in one[sid].items():
            if column in TOKENS:
                assert np.array_equal(got[column], want), f"{sid}: {column} depends on the rank that sampled it"
            else:
                np.testing.assert_allclose(got[column], want, rtol=1e-4, atol=1e-5, err_msg=f"{sid}: {column} depends on the rank")
    assert m2["behaviour_logp_max_abs_diff"] <= loop_tolerance(family)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-4, atol=1e-6)
    assert m1["grad_norm"] > 0, "the step compared must move something"
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-2)
    weight = policies.get(families.get(kind_of(family)).policy).weight_name
    assert m1[weight] == m2[weight]


# Drawn, so identical on any rank; computed, so equal up to the rounding of the other micro-batch
# shapes a rank samples in (a rank-dependent noise draw is off by the noise's own scale, ~1).
TOKENS = ("response_ids", "noise_seed")
FLOATS = ("response_logprobs", "latents", "sde_logprobs")


def sampled(table) -> dict[str, dict[str, np.ndarray]]:
    """What was sampled, per sample id: tokens and their log-probs (text), the latent trajectory
    and its SDE log-probs (flow)."""
    columns = [c for c in TOKENS + FLOATS if c in table.column_names]
    rows = table.select(["sample_id", *columns]).to_pylist()
    return {row["sample_id"]: {c: np.asarray(row[c]) for c in columns} for row in rows}


def loop_tolerance(case: str) -> float:
    """The policy's trainside tolerance: text 1e-4 (KV cache vs full forward), flow 0 (bit-identical)."""
    return policies.get(families.get(kind_of(case)).policy).default_tolerance("float32")

"""The train stack in one process: the micro-batch geometry by hand, and seeded LoRA adapters (a
restarted worker group draws the same initial adapters, whatever the process did before)."""
from __future__ import annotations

import torch

from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe


def stack_of(tmp_path, weights, **over):
    from unirl.stages.workers.worker import Worker

    recipe = build_recipe(merged(TINY["qwen3"], {"storage": {"root": str(tmp_path)}}, over))
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "run", "weights_dir": str(weights),
            "scratch": str(tmp_path / "scratch")}
    return Worker(spec, None, torch.device("cpu")).stack


def test_cut_balances_mini_batches_then_micro_batches(tmp_path, tiny_weights):
    stack = stack_of(tmp_path, tiny_weights("qwen3"))
    groups, counts = stack.cut(list(range(9)), 2, updates=2)
    # round(4.5) = 4: rows 0-3 and 4-8, each cut into micro-batches of at most 2
    assert groups == [[[0, 1], [2, 3]], [[4, 5], [6, 7], [8]]] and counts == [2, 3]
    groups, counts = stack.cut(list(range(5)), 8)
    assert groups == [[[0, 1, 2, 3, 4]]] and counts == [1]
    assert stack.cut([], 4, updates=2) == ([[], []], [0, 0])


def test_lora_adapters_start_the_same_whatever_the_global_rng(tmp_path, tiny_weights):
    lora = {"model": {"lora": {"rank": 2, "alpha": 4}}}
    torch.manual_seed(1)
    a = stack_of(tmp_path / "a", tiny_weights("qwen3"), **lora)
    torch.manual_seed(2)
    b = stack_of(tmp_path / "b", tiny_weights("qwen3"), **lora)
    pa, pb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    assert [n for n in pa if "lora_A" in n] and all(torch.equal(pa[n], pb[n]) for n in pa)
    c = stack_of(tmp_path / "c", tiny_weights("qwen3"), seed=7, **lora)
    pc = dict(c.module.named_parameters())
    assert any(not torch.equal(pa[n], pc[n]) for n in pa if "lora_A" in n), "another run seed draws other adapters"

"""`train.activation_checkpointing` (stages/train/stack.py `checkpoint_blocks`): for one model of
each kind — text, vision-language (its vision tower trained too), image flow, video flow, unified —
one RL iteration in this process (family, policy, algorithm, train stack) takes the same step with
it as without it, in fp32: the same loss and gradient norm, the same weights after the step. And
with it each block's forward runs again in the backward, which is what frees its activations."""
from __future__ import annotations

import pytest
import torch

from tests.stages.test_matrix import one_of_each_kind, pairs, recipe_of


def run_once(case: str, algo: str, weights, root, checkpointing: bool, **extra: dict) -> tuple[dict, list[torch.Tensor], int, int]:
    """(the iteration's metrics, the trainable weights after its step, forward calls of the
    blocks' linear layers, elements of the tensors autograd kept for the backward outside a
    checkpointed block)."""
    from unirl.stages.run.loop import InProcessLoop

    recipe = recipe_of(case, algo, root, **{**extra, "train": {**extra.get("train", {}), "activation_checkpointing": checkpointing}})
    loop = InProcessLoop(recipe, str(weights))
    stack = loop.worker.stack
    calls, kept = [0], [0]
    linears = [m for unit in stack.family.fsdp_units(stack.module) for m in unit.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in linears]

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept[0] += t.numel()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):  # a checkpointed block keeps its own (none)
            metrics = loop.iteration(0)
    finally:
        for hook in hooks:
            hook.remove()
    return metrics, [p.detach().clone() for p in stack.trainable], calls[0], kept[0]


# one_of_each_kind's text, vision-language, image and video models, and the unified backbone; and
# the text model with LoRA adapters and an EMA (FSDP2: tests/stages/test_matrix.py, world size 2)
KINDS = [*[(case, algo, {}) for case, algo in one_of_each_kind()], (*next(p for p in pairs() if p[0] == "transfusion"), {}),
         ("qwen3", "grpo", {"model": {"lora": {"rank": 4}}, "train": {"ema": {"decay": 0.9}}})]


@pytest.mark.parametrize("case,algo,extra", KINDS, ids=lambda x: x if isinstance(x, str) else "+".join(x) or "plain")
def test_the_step_is_the_same_with_activation_checkpointing(case, algo, extra, tiny_weights, tmp_path):
    plain, weights, forwards, kept = run_once(case, algo, tiny_weights(case), tmp_path / "plain", False, **extra)
    ckpt, weights_ckpt, forwards_ckpt, kept_ckpt = run_once(case, algo, tiny_weights(case), tmp_path / "ckpt", True, **extra)
    for key in ("train/loss", "train/grad_norm"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert len(weights) == len(weights_ckpt)
    for a, b in zip(weights, weights_ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert forwards_ckpt > forwards, f"{case}: no block ran again in the backward"
    assert kept_ckpt < kept / 2, f"{case}: autograd kept {kept_ckpt} elements with checkpointing, {kept} without"

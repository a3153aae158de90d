"""What the train step's memory knobs change and what they must not (docs/scaling.md).

* `train.activation_checkpointing` (stages/train/stack.py `checkpoint_blocks`): for one model of
  each kind — text, vision-language (its vision tower trained too), image flow, video flow, unified
  — one RL iteration in this process (family, policy, algorithm, train stack) takes the same step
  with it as without it, in fp32: the same loss and gradient norm, the same weights after the
  step. With it each block's forward runs again in the backward, which is what frees its activations.
* `train.logprob_chunk_tokens` (stages/policies/text.py `chunked_logp`): the same log-probs and
  gradients as the whole logits tensor, for a tied and an untied output head, with temperature and
  banned tokens; no tensor of the forward or backward holds more than one chunk's logits; and
  through the worker (text, and a VLM with its images) the same step, the behaviour check holding."""
from __future__ import annotations

import pytest
import torch

from tests.stages.test_matrix import one_of_each_kind, pairs, recipe_of


def run_once(case: str, algo: str, weights, root, knobs: dict, **extra: dict) -> tuple[dict, list[torch.Tensor], int, int]:
    """(the iteration's metrics, the trainable weights after its step, forward calls of the
    blocks' linear layers, elements of the tensors autograd kept for the backward outside a
    checkpointed block)."""
    from unirl.stages.run.loop import InProcessLoop

    recipe = recipe_of(case, algo, root, **{**extra, "train": {**extra.get("train", {}), **knobs}})
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
    plain, weights, forwards, kept = run_once(case, algo, tiny_weights(case), tmp_path / "plain", {}, **extra)
    ckpt, weights_ckpt, forwards_ckpt, kept_ckpt = run_once(case, algo, tiny_weights(case), tmp_path / "ckpt",
                                                            {"activation_checkpointing": True}, **extra)
    for key in ("train/loss", "train/grad_norm"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert len(weights) == len(weights_ckpt)
    for a, b in zip(weights, weights_ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert forwards_ckpt > forwards, f"{case}: no block ran again in the backward"
    assert kept_ckpt < kept / 2, f"{case}: autograd kept {kept_ckpt} elements with checkpointing, {kept} without"


# -- log-probs chunk by chunk --------------------------------------------------------------------

VOCAB, HIDDEN = 1000, 32


def text_model(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(config).train()


def a_batch() -> dict[str, torch.Tensor]:
    from unirl.stages.policies.text import token_batch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 2, 6, 11)]
    return token_batch(prompts, responses, 0, torch.device("cpu"))


class Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor that ops of the forward and backward produced over tokens and the
    vocabulary (last dim the vocabulary; not the head's weight, its gradient or their transposes,
    hidden x vocabulary, which every way of computing has)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB and t.dtype.is_floating_point
                    and t.numel() != HIDDEN * VOCAB):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_log_probs_equal_the_whole_computation_and_never_hold_the_vocabulary_tensor(tied):
    from unirl.stages.policies.text import token_logp

    batch = a_batch()
    on = batch["mask"] > 0
    banned = torch.tensor([3, 17])
    got = {}
    for chunk in (None, 4):
        model = text_model(tied)
        with Shapes() as shapes:
            logp = token_logp(model, batch, 0.7, banned=banned, chunk=chunk)
            (logp * batch["mask"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        got[chunk] = (logp, grads, shapes.largest)
    (full, full_grads, full_largest), (chunked, chunked_grads, largest) = got[None], got[4]
    torch.testing.assert_close(chunked[on], full[on], rtol=1e-6, atol=1e-6)
    assert bool((chunked[~on] == 0).all())  # off the response: nothing computed
    for name, grad in full_grads.items():
        # fp32 sums over the same tokens in another order: ~1e-6 on gradients of magnitude ~10
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-5)
    rows, tokens = batch["ids"].shape
    assert full_largest >= rows * (tokens - 1) * VOCAB  # today's: the whole (rows, tokens, vocabulary) tensor
    assert largest <= 4 * VOCAB  # chunked: one chunk of 4 tokens at a time, in the forward and the backward


def test_a_model_without_a_linear_head_is_told_to_leave_chunking_off():
    from unirl.stages.policies.text import token_logp

    class Headless(torch.nn.Module):
        def forward(self, **_):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"train.logprob_chunk_tokens: Headless has no linear output head"):
        token_logp(Headless(), a_batch(), 1.0, chunk=4)


@pytest.mark.parametrize("case,algo", [("qwen3", "grpo"), ("qwen2_5_vl", "drpo")], ids=lambda x: x)
def test_the_step_is_the_same_with_chunked_log_probs(case, algo, tiny_weights, tmp_path):
    plain, weights, _, _ = run_once(case, algo, tiny_weights(case), tmp_path / "plain", {})
    chunked, weights_chunked, _, _ = run_once(case, algo, tiny_weights(case), tmp_path / "chunk", {"logprob_chunk_tokens": 3})
    for key in ("train/loss", "train/grad_norm"):
        assert chunked[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert chunked["train/behaviour_logp_max_abs_diff"] <= 1e-4  # the sampler's record, replayed chunk by chunk
    for a, b in zip(weights, weights_chunked):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)

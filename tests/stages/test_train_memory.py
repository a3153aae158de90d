"""What the train step's memory knobs change and what they must not (docs/scaling.md).

* `train.activation_checkpointing` (stages/train/stack.py `checkpoint_blocks`): for one model of
  each kind — text, vision-language (its vision tower trained too), image flow, video flow, unified
  — one RL iteration in this process (family, policy, algorithm, train stack) takes the same step
  with it as without it, in fp32: the same loss and gradient norm, the same weights after the
  step. With it each block's forward runs again in the backward, which is what frees its activations.
* `train.logprob_chunk_tokens` (stages/policies/text.py `chunked_logp`): the same log-probs and
  gradients as the whole logits tensor, for a tied and an untied output head, with temperature and
  banned tokens; no tensor of the forward or backward holds more than one chunk's logits; and
  through the worker (text, and a VLM with its images) the same step, the behaviour check holding.
* `train.packing` (stages/policies/text.py `packed_logp`): the padded forward's log-probs and
  gradients from one forward without padding, attention kept inside each row.
* The trainside sampler (stages/policies/text_sampling.py): rows that finished leave the batch and
  the KV cache, and every row's tokens and log-probs are what it samples alone.
* `train.max_tokens_per_micro_batch` (stages/train/stack.py `token_micro_batches`): each row in
  exactly one micro-batch of the same mini-batch, within the budget; and for every loss aggregation,
  with several budgets, packing, `updates_per_batch` 2 and rollout accumulation, the same steps as
  the fixed-size cut (world size 2: tests/stages/test_matrix.py).
* `unirl validate --memory` (stages/run/memory.py): parameters and LoRA adapters counted as
  built, a language model's and a flow model's; its per-token activation probes scale to a longer
  micro-batch and a larger image; its terms follow the knobs and the ranks (at Qwen3-0.6B's
  geometry); the real-workload recipes of docs/recipes/ validate with their estimates."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
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


# -- packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_packed_log_probs_equal_the_padded_forward(chunk):
    from unirl.stages.policies.text import token_logp

    batch = a_batch()
    on = batch["mask"] > 0
    got = {}
    for packed in (False, True):
        model = text_model(tied=True)
        logp = token_logp(model, batch, 0.7, chunk=chunk, packed=packed)
        (logp * batch["mask"]).sum().backward()
        got[packed] = (logp, {n: p.grad.clone() for n, p in model.named_parameters()})
    (padded, padded_grads), (packed, packed_grads) = got[False], got[True]
    torch.testing.assert_close(packed[on], padded[on], rtol=1e-5, atol=1e-5)
    assert bool((packed[~on] == 0).all())
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_a_packed_row_attends_only_to_itself():
    """Row 1's log-probs do not change when row 0's tokens do: the packed sequence's attention
    stops at row boundaries (positions restarting at 0)."""
    from unirl.stages.policies.text import token_logp

    batch = a_batch()
    other = {k: v.clone() for k, v in batch.items()}
    other["ids"][0, :5] = (other["ids"][0, :5] + 1) % VOCAB
    model = text_model(tied=False)
    with torch.no_grad():
        a, b = (token_logp(model, x, 1.0, packed=True) for x in (batch, other))
    assert not torch.equal(a[0], b[0])  # row 0 itself changed
    torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-6)


# -- a token budget -------------------------------------------------------------------------------


def test_a_token_budget_cuts_each_mini_batch_without_losing_or_moving_a_row():
    from unirl.stages.train.stack import micro_batches, token_micro_batches

    lengths = [5, 30, 7, 7, 12, 3, 40, 9, 9, 2, 18]
    items = [f"r{i}" for i in range(len(lengths))]
    by_count = micro_batches(items, 4, updates=2)
    for budget, packed in ((30, False), (30, True), (100, False), (10, True)):
        cut = token_micro_batches(items, lengths, budget, updates=2, packed=packed)
        assert [sorted(x for mb in g for x in mb) for g in cut] == [sorted(x for mb in g for x in mb) for g in by_count]
        for mb in (mb for g in cut for mb in g):
            size = [lengths[items.index(x)] for x in mb]
            cost = sum(size) if packed else len(size) * max(size)
            assert cost <= budget or len(mb) == 1, (budget, packed, mb)  # a longer row alone
    # padded cost: rows x the longest; longest first
    assert token_micro_batches(items[:6], lengths[:6], 30, packed=False) == [[["r1"], ["r4", "r2"], ["r3", "r0", "r5"]]]
    assert token_micro_batches(items[:6], lengths[:6], 30, packed=True) == [[["r1"], ["r4", "r2", "r3"], ["r0", "r5"]]]


AGG_CASES = [({"algorithm": {"agg": agg}}, budget, packing) for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
             for budget, packing in ((10, False), (24, True))]


@pytest.mark.parametrize("extra,budget,packing", [
    *AGG_CASES,
    ({"train": {"updates_per_batch": 2}}, 16, False),
    ({"train": {"updates_per_batch": 2}}, 16, True),
], ids=lambda x: str(x))
def test_a_token_budget_takes_the_steps_of_the_fixed_size_cut(extra, budget, packing, tiny_weights, tmp_path):
    plain, weights, _, _ = run_once("qwen3", "grpo", tiny_weights("qwen3"), tmp_path / "plain", {"micro_batch_size": 3}, **extra)
    knobs = {"max_tokens_per_micro_batch": budget, "packing": packing}
    cut, weights_cut, _, _ = run_once("qwen3", "grpo", tiny_weights("qwen3"), tmp_path / "cut", knobs, **extra)
    for key in ("train/loss", "train/grad_norm"):
        assert cut[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    assert cut["train/behaviour_logp_max_abs_diff"] <= 1e-4
    for a, b in zip(weights, weights_cut):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_rollout_accumulation_with_a_token_budget_takes_the_windows_step(tiny_weights, tmp_path):
    from unirl.stages.run.loop import InProcessLoop

    got = {}
    for name, knobs in (("plain", {"micro_batch_size": 3}), ("cut", {"max_tokens_per_micro_batch": 12, "packing": True})):
        recipe = recipe_of("qwen3", "grpo", tmp_path / name, iterations=2, train={"accumulate_rollouts": 2, **knobs})
        loop = InProcessLoop(recipe, str(tiny_weights("qwen3")))
        loop.iteration(0)
        got[name] = (loop.iteration(1), [p.detach().clone() for p in loop.worker.stack.trainable])
    (plain, w_plain), (cut, w_cut) = got["plain"], got["cut"]
    for key in ("train/loss", "train/grad_norm"):
        assert cut[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(w_plain, w_cut):  # two batches' gradients summed in other orders: a few 1e-6 on Adam's first step
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_validate_refuses_the_language_knobs_where_they_cannot_apply():
    from tests.tiny import CASES, merged
    from unirl.stages.recipe import RecipeError, build_recipe

    with pytest.raises(RecipeError, match=r"train.packing: model.kind 'qwen2_5_vl' is not packed"):
        build_recipe(merged(CASES["qwen2_5_vl"], {"train": {"packing": True}}))
    with pytest.raises(RecipeError, match=r"train.max_tokens_per_micro_batch: a language model's knob"):
        build_recipe(merged(CASES["sd3"], {"algorithm": {"name": "flow_grpo"}, "train": {"max_tokens_per_micro_batch": 64}}))


# -- the sampler ----------------------------------------------------------------------------------


def test_the_sampler_drops_finished_rows_and_each_row_samples_as_it_would_alone():
    from unirl.stages.policies.text_sampling import sample

    model = text_model(tied=False).eval()
    eos = 7
    with torch.no_grad():  # a head that favours eos for some rows more than others: they finish at different steps
        model.lm_head.weight[eos] += 0.6 * model.lm_head.weight.mean(0)
    prompts = [[11, 12, 13], [400], [5, 6], [900, 901, 902, 903], [42, 43]]
    seeds = [3, 1, 4, 1, 5]
    rows_seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    common = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "eos_id": eos, "pad_id": 0, "device": torch.device("cpu")}
    together = sample(model, prompts, seeds, **common)
    hook.remove()
    lengths = sorted(len(r) for r in together.response_ids)
    assert lengths[0] < lengths[-1], "the rows should finish at different steps"
    # after the prefill, each decoding forward has only the rows still going
    assert rows_seen[0] == len(prompts) and rows_seen[1:] == [sum(n > s for n in lengths) for s in range(1, len(rows_seen))]
    for i, (p, seed) in enumerate(zip(prompts, seeds)):
        alone = sample(model, [p], [seed], **common)
        assert alone.response_ids[0] == together.response_ids[i]
        assert alone.finish_reasons[0] == together.finish_reasons[i]
        assert max(abs(a - b) for a, b in zip(alone.logprobs[0], together.logprobs[i])) < 1e-5
    # each row to its own cap (a partial rollout's segment): the first tokens of what it samples uncapped
    caps = [2, 12, 1, 3, 5]
    capped = sample(model, prompts, seeds, **common, caps=caps)
    for i, cap in enumerate(caps):
        assert capped.response_ids[i] == together.response_ids[i][:cap]
        assert capped.finish_reasons[i] == ("length" if len(together.response_ids[i]) > cap else together.finish_reasons[i])


# -- the memory estimate ----------------------------------------------------------------------------


def test_the_estimate_counts_a_models_parameters_and_lora_adapters_as_built():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unirl.stages.run.memory import LINEARS, Geometry

    for tied in (False, True):
        g = Geometry(vocab=300, hidden=48, layers=3, heads=6, kv_heads=2, head_dim=8, intermediate=80, tied=tied)
        config = Qwen3Config(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                             head_dim=8, intermediate_size=80, tie_word_embeddings=tied)
        model = Qwen3ForCausalLM(config)
        assert g.params() == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=list(LINEARS)))
    assert g.lora_params(4, list(LINEARS)) == sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_the_activation_probe_scales_to_a_longer_micro_batch():
    """The estimate measures a layer's kept bytes per token at 64 tokens and scales them: at 4 rows
    of 96 tokens, two layers keep what it says within 10% (CPU attention keeps no tokens x tokens tensor)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unirl.stages.policies.text import hidden_states_out
    from unirl.stages.run.memory import Geometry, layer_bytes_per_token

    g = Geometry(vocab=50, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, tied=False)
    kept = {}
    for layers in (1, 3):
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, intermediate_size=128)).train()
        seen = {}

        def keep(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), hidden_states_out(model):
            model(input_ids=torch.randint(0, 50, (4, 96)), attention_mask=torch.ones(4, 96, dtype=torch.long), use_cache=False)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept[layers] = sum(n for ptr, n in seen.items() if ptr not in weights)
    measured = (kept[3] - kept[1]) / 2  # one layer's, at 384 tokens
    assert layer_bytes_per_token(g, "float32", False) * 4 * 96 == pytest.approx(measured, rel=0.10)
    assert layer_bytes_per_token(g, "float32", True) <= 64 * 4 * 1.5  # checkpointed: about a layer's input, h floats a token


def test_the_estimate_follows_the_knobs_and_the_ranks(tmp_path):
    import json as json_

    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.memory import estimate, memory_table

    (tmp_path / "config.json").write_text(json_.dumps({  # Qwen3-0.6B's published geometry
        "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "tie_word_embeddings": True}))
    base = ["recipes/ar/tiny.yaml"]

    def lines(*over):
        recipe = load_recipe(REPO / base[0], [f"model.path={tmp_path}", "rollout.max_new_tokens=1024", "train.micro_batch_size=8", *over])
        return {line.what: line.bytes for line in estimate(recipe, 1024)}

    plain = lines()
    assert plain["parameters"] == 596_049_920 * 4  # Qwen3-0.6B: 0.6B parameters, fp32
    lean = lines("train.activation_checkpointing=true", "train.logprob_chunk_tokens=1024")
    assert lean["activations"] < plain["activations"] / 10 and lean["log-probs"] < plain["log-probs"] / 100
    assert lean["logits gradient"] == 1024 * 151936 * 4
    two = lines("train.nproc_per_node=2")
    assert two["AdamW moments"] == plain["AdamW moments"] // 2 and "gathered for compute" in two
    table = memory_table(estimate(load_recipe(REPO / base[0], [f"model.path={tmp_path}"]), 256))
    assert table.splitlines()[-1].startswith("peak per rank ")
    with pytest.raises(ValueError, match=r"--memory: model.kind 'flux2_klein' is not estimated yet \(qwen2_5_vl, qwen3, qwen3_vl, sd3 are\)"):
        from tests.tiny import CASES, merged
        from unirl.stages.recipe import build_recipe

        estimate(build_recipe(merged(CASES["flux2_klein"], {"algorithm": {"name": "flow_grpo"}})), 256)


@pytest.mark.slow  # two tiny VLMs built, loaded and probed: about 12 s
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_vision_language_models_geometry_counts_it_as_loaded(kind, tmp_path):
    """The language model's layers (Qwen2.5-VL's with q/k/v biases and no q/k norms) and the vision
    tower, read from the tiny folder's config, count the loaded model's parameters; the estimate
    trains the tower only where the recipe does."""
    from tests.tiny import CASES, merged
    from unirl.stages.models.family import get_family
    from unirl.stages.recipe import build_recipe
    from unirl.stages.run.memory import Geometry, estimate

    family = get_family(kind)
    recipe = build_recipe(merged(CASES[kind], {"algorithm": {"name": "grpo"}}))
    g = Geometry(**family.text_geometry(recipe.model))
    bundle = family.load(family.materialize(recipe.model, tmp_path), recipe.model, "cpu")
    assert g.params() == sum(p.numel() for p in bundle.module.parameters())
    assert g.vision == sum(p.numel() for p in bundle.module.model.visual.parameters()) > 0
    assert (g.qk_norm, g.qkv_bias) == ((False, True) if kind == "qwen2_5_vl" else (True, False))
    for train_vision in (False, True):
        lines = {line.what: line.bytes for line in estimate(recipe.model_copy(update={"model": recipe.model.model_copy(
            update={"train_vision": train_vision})}), 64)}
        assert lines["gradients"] == (g.params() - (0 if train_vision else g.vision)) * 4


def test_the_flow_estimate_counts_the_folder_as_loaded(tmp_path):
    """A tiny SD3 folder: the transformer's parameters and buffers, each frozen model's and LoRA's,
    counted from the configs on the meta device, are those of the loaded bundle."""
    from tests.tiny import CASES, merged
    from unirl.stages.models.sd3 import SD3
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.config_base import LoraConfig

    recipe = build_recipe(merged(CASES["sd3"], {"algorithm": {"name": "flow_grpo"}, "model": {"lora": {"rank": 4}}}))
    folder = SD3.materialize(recipe.model, tmp_path)
    probe = SD3.memory_probe(recipe.model.model_copy(update={"path": str(folder)}))
    bundle = SD3.load(folder, recipe.model, "cpu")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert probe.trained == count(bundle.transformer) and probe.buffers == sum(b.numel() for b in bundle.transformer.buffers())
    assert probe.frozen == {name: count(bundle.text[name]) + sum(b.numel() for b in bundle.text[name].buffers())
                            for name in ("text_encoder", "text_encoder_2", "text_encoder_3")} | {
                                "vae": count(bundle.vae) + sum(b.numel() for b in bundle.vae.buffers())}
    blocks = SD3.fsdp_units(bundle.transformer)
    assert probe.blocks == len(blocks) and probe.outside == probe.trained - sum(count(b) for b in blocks)
    SD3.add_lora(bundle, LoraConfig(rank=4))
    assert probe.lora == sum(p.numel() for p in bundle.transformer.parameters() if p.requires_grad)


def test_the_flow_probe_scales_to_a_larger_image():
    """The flow estimate measures a block's kept bytes per token over 8 x 8 patches and 16 text
    tokens, and scales them: an SD3 transformer of the same width with 1 and 3 blocks, 2 rows of a
    4x larger latent and 24 text tokens, keeps what it says per block within 10%; checkpointed, a
    block keeps its input (h floats a token for each stream's tokens)."""
    from tests.tiny import CASES, merged
    from unirl.stages.models.sd3 import SD3
    from unirl.stages.recipe import build_recipe
    from unirl.stages.run.memory import block_bytes_per_token, kept_bytes

    recipe = build_recipe(merged(CASES["sd3"], {"algorithm": {"name": "flow_grpo"}, "model": {"tiny": {"image_size": 64}}}))
    probe, geo = SD3.memory_probe(recipe.model), SD3.recipe_geometry(recipe.model)
    per_block, _ = block_bytes_per_token(SD3, probe, geo, None, "float32", False)
    side = geo.spatial * geo.patch * 16  # 16 x 16 patches, more than the probe's 8 x 8
    shape = geo.latent_shape(side)
    kept = {}
    for blocks in (1, 3):
        module, run = probe.make(blocks, "float32")
        x, sigma = torch.randn((2, *shape)), torch.rand(2)
        kept[blocks] = kept_bytes(module.train(), lambda module=module, run=run, x=x, sigma=sigma: run(module, x, sigma, 24))
    tokens = 2 * (geo.tokens(shape) + 24)
    assert per_block * tokens == pytest.approx((kept[3] - kept[1]) / 2, rel=0.10)
    hidden = recipe.model.tiny.num_heads * recipe.model.tiny.head_dim
    assert block_bytes_per_token(SD3, probe, geo, None, "float32", True)[0] == pytest.approx(hidden * 4, rel=0.25)


@pytest.mark.slow  # 13 s: four decoder layers at Qwen3-4B's width and SD3.5-medium's blocks are probed
def test_the_real_workload_recipes_validate_with_their_estimates(tmp_path):
    """docs/recipes/ (docs/scaling.md): Qwen3-4B-Base with DRPO on 8 GPUs and SD3.5-medium with LoRA
    Flow-GRPO validate against config-only folders of the releases (benchmarks/released.py) and
    their estimates count the published sizes and fit an 80 GB GPU."""
    import sys

    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.memory import estimate, memory_table

    sys.path.insert(0, str(REPO / "benchmarks"))
    from released import qwen3, sd35_medium

    (tmp_path / "math.jsonl").write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(300)))
    text = load_recipe(REPO / "docs/recipes/qwen3-4b-drpo-math.yaml",
                       [f"model.path={qwen3(tmp_path, 'Qwen3-4B-Base')}", f"data.path={tmp_path / 'math.jsonl'}"])
    image = load_recipe(REPO / "docs/recipes/sd35-medium-lora-flow-grpo.yaml", [f"model.path={sd35_medium(tmp_path)}"])
    assert text.train.nproc_per_node == image.train.nproc_per_node == 8
    for recipe, params in ((text, 4_022_468_096), (image, 2_243_171_520)):
        lines = {line.what: line for line in estimate(recipe, 512)}
        assert lines["parameters"].bytes == params * 2 // 8  # bf16, sharded over 8 ranks
        peak = float(memory_table(list(lines.values())).splitlines()[-1].split()[3])
        assert 4 < peak < 40, memory_table(list(lines.values()))
    assert lines["frozen models"].bytes > 10 * 2**30  # T5-XXL, both CLIPs and the VAE in bf16 on every rank
    assert lines["gradients"].bytes < 0.01 * lines["parameters"].bytes * 8  # LoRA only

"""`unirl validate --memory`: what one rank of a language model's run holds at its peak, term by
term, before anything is loaded (docs/scaling.md).

The static terms are counted from the architecture (its `config.json`, or the tiny one): the
parameters (sharded by FSDP2 over the ranks, one layer and the root gathered whole while they
compute), their gradients, AdamW's two moments, an EMA copy and a frozen reference copy where the
recipe keeps them. The activations are what autograd keeps for the backward of the largest
micro-batch: per token, measured by running one and two decoder layers of the recipe's own width
and dtype (with a 16-token vocabulary, 64 tokens, so it costs a fraction of a second) through
transformers' forward on this machine, the knobs applied (`activation_checkpointing` keeps a
layer's input, and one layer's activations come back in the backward), then scaled to the
micro-batch's tokens (they grow linearly with tokens: CPU and flash attention keep no
tokens x tokens tensor). The log-probs term is the head's logits and their fp32 log-softmax over
every position, or with `logprob_chunk_tokens` only the scored positions' hidden states; the
backward makes the logits' gradient at once (one chunk's with chunking). The trainside sampler's
KV cache holds its rows x (prompt + max_new_tokens) positions per layer, at another time than the
train step.

An estimate, not a measurement: allocator slack, the framework's own buffers and the process's
libraries come on top; benchmarks/train_step.py compares it with measured peaks (docs/scaling.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unirl.stages.algorithms import get_algorithm
from unirl.stages.models.family import get_family
from unirl.stages.policies.text import hidden_states_out
from unirl.stages.runtime.registry import engines
from unirl.stages.train.stack import checkpoint_blocks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PROBE_TOKENS = 64  # tokens of the activation probe (activations grow linearly with tokens)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Geometry:
    """What the estimate needs of a decoder-only language model's architecture."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, q/k norms, the SwiGLU MLP, two RMSNorms."""
        attn = self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads) + self.heads * self.head_dim * self.hidden
        return attn + 2 * self.head_dim + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def root_params(self) -> int:
        """What is not in a layer: the embedding, the output head unless tied to it, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.root_params() + self.layers * self.layer_params()

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """LoRA adapters (A: rank x in, B: out x rank) on each layer's named linears."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv), "o_proj": (q, self.hidden),
                  "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                  "down_proj": (self.intermediate, self.hidden)}
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def layer_bytes_per_token(g: Geometry, dtype: str, checkpointing: bool) -> float:
    """Bytes one decoder layer keeps for the backward per token of a micro-batch: one and two
    layers of this width run on this machine over PROBE_TOKENS tokens (a 16-token vocabulary),
    the difference over the tokens."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    from transformers import Qwen3Config, Qwen3ForCausalLM  # start-up time: transformers loads on first use

    kept = []
    for layers in (1, 2):
        config = Qwen3Config(vocab_size=16, hidden_size=g.hidden, num_hidden_layers=layers, num_attention_heads=g.heads,
                             num_key_value_heads=g.kv_heads, head_dim=g.head_dim, intermediate_size=g.intermediate,
                             max_position_embeddings=PROBE_TOKENS)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).train()
        if checkpointing:
            checkpoint_blocks([m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")])
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), hidden_states_out(model):
            model(input_ids=ids, use_cache=False)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # a layer's weights are not activations
        kept.append(sum(n for ptr, n in seen.items() if ptr not in weights))
    return max(kept[1] - kept[0], 0) / PROBE_TOKENS


@dataclass(frozen=True)
class Line:
    what: str
    bytes: int
    how: str


def estimate(recipe: Any, prompt_tokens: int) -> list[Line]:
    """Each term of one rank's peak for `recipe`, with prompts of `prompt_tokens` tokens."""
    found = get_family(recipe.model.kind).text_geometry(recipe.model)
    if found is None:
        raise ValueError(f"--memory: model.kind {recipe.model.kind!r} is not estimated yet (decoder-only language models "
                         "are: qwen3); docs/scaling.md")
    g = Geometry(**found)
    t, pb = recipe.train, DTYPE_BYTES[recipe.model.dtype]
    world = t.nnodes * t.nproc_per_node
    lora = recipe.model.lora
    trained = g.lora_params(lora.rank, lora.target_modules or list(LINEARS)) if lora else g.params()
    lines = [Line("parameters", g.params() * pb // world, f"{g.params() / 1e6:.1f}M x {pb} B / {world} rank(s)")]
    if world > 1:
        lines.append(Line("gathered for compute", (g.layer_params() + g.root_params()) * pb,
                          "one decoder layer, the embedding and the head, whole while they compute"))
    lines += [Line("gradients", trained * pb // world, f"{trained / 1e6:.2f}M trained parameters"),
              Line("AdamW moments", 2 * trained * pb // world, "two per trained parameter")]
    if t.ema:
        lines.append(Line("EMA", trained * pb // world, "a copy of the trained parameters"))
    if get_algorithm(recipe.algorithm.name)(recipe.algorithm, recipe).needs_reference and not lora:
        lines.append(Line("reference policy", g.params() * pb // world, "a frozen copy (LoRA would disable its adapters instead)"))
    longest = prompt_tokens + recipe.rollout.max_new_tokens
    if t.max_tokens_per_micro_batch:  # the budget's tokens, padded rows of the longest length at most
        tokens = t.max_tokens_per_micro_batch if t.packing else max(1, t.max_tokens_per_micro_batch // longest) * longest
        shape = f"a budget of {t.max_tokens_per_micro_batch} tokens"
    else:
        tokens, shape = t.micro_batch_size * longest, f"{t.micro_batch_size} rows of {longest} tokens"
    scored = tokens * recipe.rollout.max_new_tokens // longest
    per_token = layer_bytes_per_token(g, recipe.model.dtype, t.activation_checkpointing)
    embed = tokens * g.hidden * pb
    lines.append(Line("activations", int(per_token * tokens * g.layers) + embed,
                      f"{shape}: {per_token / 1024:.1f} KiB a token a layer x {g.layers} layers"
                      + (" (checkpointed: its input)" if t.activation_checkpointing else "")))
    if t.activation_checkpointing:
        again = layer_bytes_per_token(g, recipe.model.dtype, False)
        lines.append(Line("one layer recomputed", int(again * tokens), "a checkpointed layer's activations, back in the backward"))
    if t.logprob_chunk_tokens:
        lines.append(Line("log-probs", scored * g.hidden * pb,
                          f"chunks of {t.logprob_chunk_tokens}: the {scored} scored positions' hidden states"))
    else:
        fp32 = pb + 4 + (4 if pb != 4 else 0)  # the logits, their fp32 copy (none when they are fp32), the log-softmax
        lines.append(Line("log-probs", tokens * g.vocab * fp32, f"{tokens} positions x {g.vocab}: logits and their fp32 log-softmax"))
    at_once = min(t.logprob_chunk_tokens, scored) if t.logprob_chunk_tokens else tokens
    lines.append(Line("logits gradient", at_once * g.vocab * 4, f"{at_once} positions x {g.vocab} fp32, at once in the backward"))
    if not engines.get(recipe.rollout.engine.name).own_weights:  # the trainer's own sampler
        kv = t.micro_batch_size * longest * g.layers * 2 * g.kv_heads * g.head_dim * pb
        lines.append(Line("KV cache (sampling)", kv, f"{t.micro_batch_size} rows x {longest} positions x {g.layers} layers, "
                          "at another time than the train step"))
    return lines


STATIC = ("parameters", "gathered for compute", "gradients", "AdamW moments", "EMA", "reference policy")


def memory_table(lines: list[Line]) -> str:
    """The terms as a short table, and the peak: the train step's or sampling's, the larger."""
    static = sum(line.bytes for line in lines if line.what in STATIC)
    train = sum(line.bytes for line in lines if not line.what.startswith("KV cache"))
    sampling = static + sum(line.bytes for line in lines if line.what.startswith("KV cache"))
    width = max(len(line.what) for line in lines)
    out = [f"{line.what:<{width}}  {line.bytes / 2**30:8.3f} GiB  {line.how}" for line in lines]
    out.append(f"{'peak per rank':<{width}}  {max(train, sampling) / 2**30:8.3f} GiB  "
               + ("sampling" if sampling > train else "the train step") + "; allocator slack and libraries come on top")
    return "\n".join(out)

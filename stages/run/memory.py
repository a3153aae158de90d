"""`unirl validate --memory`: what one rank of a run holds at its peak, term by term, before
anything is loaded (docs/scaling.md), for language models (qwen3), vision-language models
(qwen2_5_vl, qwen3_vl: the vision tower among the parameters) and flow models (sd3).

The static terms are counted from the architecture (its config files, or the tiny one's): the
parameters (sharded by FSDP2 over the ranks, one layer or block and the root gathered whole while
they compute), their gradients, AdamW's two moments, an EMA copy and a frozen reference copy where
the recipe keeps them; a flow model's text encoders and VAE (frozen, whole on every rank) and its
buffers (a position table), each component built on the meta device from its config. The
activations are what autograd keeps for the backward of the largest micro-batch, per token,
measured on this machine with one and two layers (blocks) of the recipe's own width and dtype over
a few tokens (a fraction of a second), the knobs applied (`activation_checkpointing` keeps a
layer's input, and one layer's activations come back in the backward), then scaled to the
micro-batch's tokens (they grow linearly with tokens: CPU and flash attention keep no tokens x
tokens tensor). A language model's log-probs term is the head's logits and their fp32 log-softmax
over every position, or with `logprob_chunk_tokens` only the scored positions' hidden states; the
backward makes the logits' gradient at once (one chunk's with chunking); the trainside sampler's
KV cache holds its rows x (prompt + max_new_tokens) positions per layer, at another time than the
train step. A flow model's micro-batch is its rows (twice with classifier-free guidance) of latent
plus text tokens, one denoising step's forward and backward at a time.

An estimate, not a measurement: allocator slack, the framework's own buffers and the process's
libraries come on top; benchmarks/train_step.py compares it with measured peaks (docs/scaling.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unirl.stages.algorithms import get_algorithm
from unirl.stages.models.family import Family, get_family
from unirl.stages.models.flow_family import FlowFamily
from unirl.stages.policies.text import hidden_states_out
from unirl.stages.runtime.registry import engines, families
from unirl.stages.train.stack import checkpoint_blocks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PROBE_TOKENS = 64  # tokens of the activation probe (activations grow linearly with tokens)
PROBE_TEXT = 16  # text tokens of a flow transformer's probe
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
    qk_norm: bool = True  # Qwen3's q/k RMSNorms (Qwen2's layers have none, and biases on q, k, v)
    qkv_bias: bool = False
    vision: int = 0  # a vision-language model's vision tower: its parameters
    vision_trained: bool = False

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections (their biases), q/k norms, the SwiGLU MLP, two RMSNorms."""
        attn = self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads) + self.heads * self.head_dim * self.hidden
        norms = 2 * self.head_dim if self.qk_norm else 0
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return attn + norms + bias + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def root_params(self) -> int:
        """What is not in a layer: the embedding, the output head unless tied to it, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.root_params() + self.layers * self.layer_params() + self.vision

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """LoRA adapters (A: rank x in, B: out x rank) on each layer's named linears."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv), "o_proj": (q, self.hidden),
                  "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                  "down_proj": (self.intermediate, self.hidden)}
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


@dataclass(frozen=True)
class Line:
    what: str
    bytes: int
    how: str


def kept_bytes(model: Any, forward: Any, units: list[Any] | None = None) -> int:
    """Bytes autograd keeps for the backward while `forward()` runs `model`: the storages the saved
    tensors hold, the model's own weights not counted (they are not activations), and with
    checkpointed `units` their inputs (what a non-reentrant checkpoint keeps to run the unit again:
    it holds them itself, out of sight of the saved-tensors hooks)."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def inputs(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                keep(t)

    hooks = [u.register_forward_pre_hook(inputs, with_kwargs=True) for u in units or []]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            forward()
    finally:
        for hook in hooks:
            hook.remove()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)


def layer_bytes_per_token(g: Geometry, dtype: str, checkpointing: bool) -> float:
    """Bytes one decoder layer keeps for the backward per token of a micro-batch: one and two
    layers of this width run on this machine over PROBE_TOKENS tokens (a 16-token vocabulary),
    the difference over the tokens."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM  # start-up time: on first use

    kept = []
    Config, Model = (Qwen3Config, Qwen3ForCausalLM) if g.qk_norm else (Qwen2Config, Qwen2ForCausalLM)
    for layers in (1, 2):
        config = Config(vocab_size=16, hidden_size=g.hidden, num_hidden_layers=layers, num_attention_heads=g.heads,
                             num_key_value_heads=g.kv_heads, head_dim=g.head_dim, intermediate_size=g.intermediate,
                             max_position_embeddings=PROBE_TOKENS)
        model = Model(config).to(getattr(torch, dtype)).train()
        units = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")] if checkpointing else []
        checkpoint_blocks(units)
        ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.long)

        def forward(model: Any = model, ids: torch.Tensor = ids) -> None:
            with hidden_states_out(model):
                model(input_ids=ids, use_cache=False)

        kept.append(kept_bytes(model, forward, units))
    return max(kept[1] - kept[0], 0) / PROBE_TOKENS


def block_bytes_per_token(family: Any, probe: Any, geo: Any, frames: int | None, dtype: str,
                          checkpointing: bool) -> tuple[float, float]:
    """A flow transformer's bytes kept for the backward per token of its sequence (latent and text
    tokens): (one block's, the rest's: embeddings, final layer), from transformers of the recipe's
    width with one and two blocks run on this machine over an image of 8 x 8 patches (fewer where
    the position table is smaller) and PROBE_TEXT text tokens."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read

    side = geo.spatial * geo.patch * min(8, geo.max_patches or 8)
    shape = geo.latent_shape(side, frames)
    tokens = geo.tokens(shape) + PROBE_TEXT
    kept = []
    for blocks in (1, 2):
        module, run = probe.make(blocks, dtype)
        module.train()
        units = family.fsdp_units(module) if checkpointing else []
        checkpoint_blocks(units)
        x, sigma = torch.zeros((1, *shape)), torch.full((1,), 0.5)
        kept.append(kept_bytes(module, lambda module=module, run=run, x=x, sigma=sigma: run(module, x, sigma, PROBE_TEXT), units))
    return max(kept[1] - kept[0], 0) / tokens, max(2 * kept[0] - kept[1], 0) / tokens


def static_lines(recipe: Any, total: int, trained: int, gathered: int, frozen: dict[str, int], unit: str) -> list[Line]:
    """The terms that do not depend on the batch: parameters sharded over the ranks (`gathered` of
    them whole while one `unit` computes), frozen models whole on every rank, gradients and AdamW's
    moments of the `trained` ones, EMA and reference copies where the recipe keeps them."""
    t, pb, lora = recipe.train, DTYPE_BYTES[recipe.model.dtype], recipe.model.lora
    world = t.nnodes * t.nproc_per_node
    lines = [Line("parameters", total * pb // world, f"{total / 1e6:.1f}M x {pb} B / {world} rank(s)")]
    if world > 1:
        lines.append(Line("gathered for compute", gathered * pb, f"{unit}, whole while they compute"))
    if frozen:
        lines.append(Line("frozen models", sum(frozen.values()) * pb,
                          ", ".join(f"{name} {n / 1e6:.1f}M" for name, n in frozen.items()) + ", whole on every rank"))
    lines += [Line("gradients", trained * pb // world, f"{trained / 1e6:.2f}M trained parameters"),
              Line("AdamW moments", 2 * trained * pb // world, "two per trained parameter")]
    if t.ema:
        lines.append(Line("EMA", trained * pb // world, "a copy of the trained parameters"))
    if get_algorithm(recipe.algorithm.name)(recipe.algorithm, recipe).needs_reference and not lora:
        lines.append(Line("reference policy", total * pb // world, "a frozen copy (LoRA would disable its adapters instead)"))
    return lines


def estimate(recipe: Any, prompt_tokens: int) -> list[Line]:
    """Each term of one rank's peak for `recipe`, with prompts of `prompt_tokens` tokens (language
    models; a flow model's prompts are its text encoders' fixed lengths)."""
    family = get_family(recipe.model.kind)
    if issubclass(family, FlowFamily):
        return flow_estimate(recipe, family)
    found = family.text_geometry(recipe.model)
    if found is None:
        raise ValueError(f"--memory: model.kind {recipe.model.kind!r} is not estimated yet ({', '.join(estimated())} are); "
                         "docs/scaling.md")
    g = Geometry(**found)
    t, pb = recipe.train, DTYPE_BYTES[recipe.model.dtype]
    lora = recipe.model.lora
    vision = g.vision if g.vision_trained else 0
    trained = (g.lora_params(lora.rank, lora.target_modules or list(LINEARS)) + vision if lora
               else g.params() - g.vision + vision)
    lines = static_lines(recipe, g.params(), trained, g.layer_params() + g.root_params(), {},
                         "one decoder layer, the embedding and the head")
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
                      + (" (checkpointed: its input)" if t.activation_checkpointing else "")
                      + ("; an image's tokens count among the prompt's" if g.vision else "")
                      + ("; the vision tower's own not counted" if g.vision_trained else "")))
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


def flow_estimate(recipe: Any, family: Any) -> list[Line]:
    """A flow model's terms: the transformer trains (or its LoRA adapters), the text encoders and
    the VAE stay whole and frozen on every rank; a micro-batch is `micro_batch_size` rows (twice
    that with classifier-free guidance: the forward runs uncond and cond together) of the image's
    latent tokens plus the prompt's text tokens, one denoising step's forward and backward at a
    time (the flow losses go backward step by step)."""
    probe = family.memory_probe(recipe.model)
    if probe is None:
        raise ValueError(f"--memory: model.kind {recipe.model.kind!r} is not estimated yet ({', '.join(estimated())} are); "
                         "docs/scaling.md")
    t, cfg, sampler = recipe.train, recipe.model, recipe.rollout.sampler
    geo = family.recipe_geometry(cfg)
    native, native_frames = family.native_media(cfg)
    image, frames = sampler.image_size or native, (sampler.num_frames or native_frames) if geo.video else None
    trained = probe.lora or probe.trained
    lines = static_lines(recipe, probe.trained, trained, probe.block_params + probe.outside,
                         probe.frozen, "one transformer block and what is outside the blocks")
    if probe.buffers:
        pb = DTYPE_BYTES[cfg.dtype]
        lines.insert(1, Line("buffers", probe.buffers * pb, f"{probe.buffers / 1e6:.1f}M (a position table), whole on every rank"))
    rows = t.micro_batch_size * (2 if sampler.guidance_scale > 1 and probe.cfg_doubles else 1)
    tokens = rows * (geo.tokens(geo.latent_shape(image, frames)) + probe.text_tokens)
    block, rest = block_bytes_per_token(family, probe, geo, frames, cfg.dtype, t.activation_checkpointing)
    lines.append(Line("activations", int((block * probe.blocks + rest) * tokens),
                      f"{rows} rows of {tokens // rows} tokens ({image} px and {probe.text_tokens} text): "
                      f"{block / 1024:.1f} KiB a token a block x {probe.blocks} blocks"
                      + (" (checkpointed: its input)" if t.activation_checkpointing else "")))
    if t.activation_checkpointing:
        again, _ = block_bytes_per_token(family, probe, geo, frames, cfg.dtype, False)
        lines.append(Line("one block recomputed", int(again * tokens), "a checkpointed block's activations, back in the backward"))
    return lines


def estimated() -> list[str]:
    """The model kinds `--memory` estimates: those whose family says its architecture."""
    def says(fam: type, method: str, base: type) -> bool:  # a class below `base` defines `method`
        return any(method in vars(c) for c in fam.__mro__ if c is not base and issubclass(c, base))

    return [kind for kind, fam in families.items()
            if says(fam, "text_geometry", Family) or (issubclass(fam, FlowFamily) and says(fam, "memory_probe", FlowFamily))]


STATIC = ("parameters", "buffers", "gathered for compute", "frozen models", "gradients", "AdamW moments", "EMA", "reference policy")


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

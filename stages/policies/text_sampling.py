"""Autoregressive sampling of the text policy, with fp32 log-probs recorded at sampling time.

Each sample draws its randomness from its own generator, seeded from (run seed, iteration,
sample id), so a sample's tokens do not depend on the batch it was in, the rank that made it, or
whether the run was resumed. A row that finished leaves the batch and the KV cache, so the decoding
steps compute only the rows still going; the cache holds at most rows x (longest prompt +
max_new_tokens) positions per layer (keys and values: 2 x kv heads x head dim each). Every rank
runs the same number of forward passes (FSDP2 gathers parameters collectively), stopping only
when all ranks' samples are finished.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unirl.stages.kernels import no_grad

if TYPE_CHECKING:
    import torch


@dataclass
class SampleOutput:
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    # per row asked for them (`sample(prompt_logprobs=)`): log p(prompt[i] | prompt[:i]) at
    # temperature 1 for i >= 1, from the prefill's logits; None for the other rows
    prompt_logprobs: list[list[float] | None] | None = None


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches `top_p`, renormalized. probs: (B, V)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row whose CDF interval contains u. probs: (B, V), u: (B,) in [0, 1)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers 5, else `past_key_values`."""
    peft_base = getattr(model, "get_base_model", None)
    base = peft_base() if peft_base is not None else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def log_probs(logits: torch.Tensor, temperature: float, banned: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / temperature) in fp32 over the last dim, with the `banned` token ids
    (a VLM's image placeholders, which a response must not contain) at probability 0: their
    logits are -1e9, not -inf, so the log-probs of the prompt's own image tokens stay finite
    (losses multiply them by a zero mask, and -inf * 0 would be nan)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    scaled = logits.float() / temperature
    if banned is not None:
        scaled = scaled.index_fill(-1, banned.to(scaled.device), -1e9)
    return torch.log_softmax(scaled, dim=-1)


def next_positions(positions: torch.Tensor) -> torch.Tensor:
    """Position of the first generated token after left-padded prompts. 1-D (B, T) -> (B,): the
    last prompt position + 1. M-RoPE (3, B, T) -> (3, B): one past the largest position of the
    prompt on any axis, on every axis (text after an image grid continues there, which is what a
    full forward over prompt + response gives the response tokens)."""
    if positions.dim() == 2:
        return positions[:, -1] + 1
    return (positions.amax(dim=(0, 2)) + 1).unsqueeze(0).expand(positions.shape[0], -1)


@no_grad
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    greedy: bool = False,
    inputs: Callable[[torch.Tensor, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]] | None = None,
    banned: torch.Tensor | None = None,
    prompt_logprobs: Sequence[bool] = (),
    caps: Sequence[int] = (),
) -> SampleOutput:
    """Sample one response per prompt. The recorded log-prob of a token is
    log softmax(logits / temperature) at that token, in fp32 (the quantity training recomputes).
    `inputs(ids, attn)`: the prompts' other model inputs for the prefill (a VLM's pixel values)
    and their positions, (B, T) or M-RoPE's (3, B, T); default: 1-D positions of the text.
    `banned`: token ids never sampled (`log_probs`). `prompt_logprobs[i]`: row i's prompt log-probs
    too (SampleOutput.prompt_logprobs), read off the prefill, which computes their logits anyway.
    `caps[i]`: row i's own length cap, at most max_new_tokens (a continued partial rollout's)."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    import torch.distributed as dist  # start-up time: loaded on first use, not when a recipe is read

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    empty = not prompts
    if empty:  # this rank has nothing to do but must take part in every forward
        prompts, seeds = [[eos_id]], [0]
    from transformers import DynamicCache  # start-up time: transformers loads on first use, not when a recipe is read

    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attn = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    extra: dict[str, torch.Tensor] = {}
    if inputs is not None:
        extra, positions = inputs(input_ids, attn)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    cache = {cache_kwarg(model): DynamicCache()}
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True, **cache, **extra)
    prompt_lps: list[list[float] | None] | None = None
    if any(prompt_logprobs) and not empty:
        prompt_lps = [None] * batch
        for i, wanted in enumerate(prompt_logprobs):
            if wanted:
                start = width - len(prompts[i])
                lp = log_probs(out.logits[i, start:-1], 1.0, None)
                prompt_lps[i] = lp.gather(-1, input_ids[i, start + 1:].unsqueeze(-1)).squeeze(-1).float().cpu().tolist()
    logits = out.logits[:, -1, :]
    next_pos = next_positions(positions)
    responses: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    rows = list(range(batch))  # the rows of the batch still decoding, in the order the model sees them
    for step in range(max_new_tokens):
        going: list[int] = []  # positions in `rows` of the rows that go on
        if rows:
            logp = log_probs(logits, temperature, banned).cpu()
            if greedy:
                tokens = logp.argmax(-1)
            else:
                u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
                tokens = inverse_cdf(top_p_filter(logp.exp(), top_p), u)
            token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            for k, i in enumerate(rows):
                responses[i].append(int(tokens[k]))
                logprobs[i].append(float(token_logp[k]))
            going = [k for k in range(len(rows)) if int(tokens[k]) != eos_id
                     and (not caps or len(responses[rows[k]]) < caps[rows[k]])]
        pending = torch.tensor([1 if going else 0], dtype=torch.int64, device=device)
        if distributed:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        if int(pending.item()) == 0 or step == max_new_tokens - 1:
            break
        # Finished rows leave the batch and the KV cache: the next forwards compute only the rows
        # still decoding. A rank whose rows all finished keeps one row, fed padding and never read
        # again, to take part in the forwards the other ranks still run (FSDP2 gathers collectively).
        keep = going or [0]
        if len(keep) < attn.shape[0]:
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache[cache_kwarg(model)].batch_select_indices(index)
            attn, next_pos = attn[index], next_pos[..., index]
        feed = tokens[going].to(device) if going else torch.full((1,), pad_id, dtype=torch.long, device=device)
        rows = [rows[k] for k in going]
        attn = torch.cat([attn, torch.ones((len(feed), 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(input_ids=feed.unsqueeze(-1), attention_mask=attn, position_ids=next_pos.unsqueeze(-1), use_cache=True, **cache)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    reasons = ["stop" if r and r[-1] == eos_id else "length" for r in responses]
    if empty:
        return SampleOutput([], [], [])
    return SampleOutput(responses, logprobs, reasons, prompt_lps)

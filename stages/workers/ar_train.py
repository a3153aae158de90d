"""Training pieces of the AR worker: token batches, per-token log-probs, the policy-loss dispatch,
the learning-rate schedule and the EMA of trainable weights. Pure functions where they can be."""
from __future__ import annotations

import math
from typing import Any

import torch

from stages.algorithms import LossOutput, drpo_loss, grpo_loss, gspo_loss


def token_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids and a mask over response positions of the labels
    (logits at position t predict token t+1). Shapes: ids/attn (B, T), mask (B, T-1)."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        mask[i, len(p) - 1:len(s) - 1] = 1.0
    return {"ids": ids.to(device), "attn": attn.to(device), "mask": mask.to(device)}


def token_logp(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at the next token, fp32. Returns (B, T-1)."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def policy_loss(algo: Any, logp, old_logp, adv, mask, horizon: int) -> LossOutput:
    """The recipe's policy loss (DESIGN.md section 5) on one micro-batch."""
    if algo.name == "grpo":
        return grpo_loss(logp, old_logp, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.agg, horizon=horizon)
    if algo.name == "gspo":
        return gspo_loss(logp, old_logp, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high)
    if algo.name == "drpo":
        return drpo_loss(logp, old_logp, adv, mask, epsilon=algo.epsilon, mu_weighted=algo.mu_weighted, agg=algo.agg, horizon=horizon)
    raise ValueError(f"algorithm.name: {algo.name!r} is not a language-model algorithm (allowed: grpo, gspo, drpo)")


def sequence_level(algo: Any) -> bool:
    """Whether the loss averages over sequences (micro-batches weigh by sequences, not tokens)."""
    return algo.name == "gspo" or getattr(algo, "agg", "token_mean") != "token_mean"


def lr_factor(step: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr before optimizer step `step` (0-based).
    constant: 1 after warm-up; linear: warm-up then linear decay to min_ratio at `total`;
    cosine: warm-up then min_ratio + (1-min_ratio) * (1 + cos(pi * progress)) / 2."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r} (allowed: constant, linear, cosine)")


class EMA:
    """theta_ema <- decay * theta_ema + (1 - decay) * theta, over the trainable parameters (local
    shards under FSDP2, so the EMA is sharded like the model)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)

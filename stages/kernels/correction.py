"""The off-policy correction's weights (stages/algorithms/correction.py says what they correct
and how a recipe asks for them; docs/architecture.md, "The math contract")."""
from __future__ import annotations

import torch

# exp() of a log-ratio beyond this is inf in float32; the weights are capped or masked anyway.
LOG_RATIO_LIMIT = 80.0


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, *, level: str,
                       mode: str, cap: float, band: tuple[float, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """proximal o, behaviour b, mask m: (B, L). Returns the detached weights, (B, L) for
    level "token" (0 off the mask) or (B,) for "sequence", and their statistics over the mask
    (token level) or over the samples holding a token (sequence level):
    is_weight_mean / _max / _min (after truncation or masking), is_truncated_frac (raw w > C,
    truncate mode), is_masked_frac (w outside the band, mask mode)."""
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        raise ValueError(f"importance_weights: level must be token|sequence and mode truncate|mask, got {level!r}, {mode!r}")
    m = mask.to(torch.float32)
    on = m > 0
    log_ratio = torch.where(on, proximal.detach().float() - behaviour.detach().float(), torch.zeros_like(m))
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1)
        on = m.sum(-1) > 0
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    lo, hi = band if band is not None else (1.0 / cap, cap)
    if mode == "truncate":
        hit = raw > cap
        w = raw.clamp(max=cap)
    else:
        hit = (raw < lo) | (raw > hi)
        w = torch.where(hit, torch.zeros_like(raw), raw)
    w = torch.where(on, w, torch.zeros_like(w))
    count = on.sum().clamp(min=1).float()
    stats = torch.stack([
        w.sum() / count,
        torch.where(on, w, -torch.inf).max(),
        torch.where(on, w, torch.inf).min(),
        (hit & on).sum() / count,
    ]).tolist()
    metrics = {"is_weight_mean": stats[0], "is_weight_max": stats[1], "is_weight_min": stats[2],
               "is_truncated_frac" if mode == "truncate" else "is_masked_frac": stats[3]}
    return w.detach(), metrics


def weighted_advantage(adv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """adv (B,) times the importance weights: (B, L) token weights give a per-token advantage
    (B, L), (B,) sequence weights a per-sequence one (B,)."""
    return adv[:, None] * weights if weights.dim() == 2 else adv * weights

"""The EMA old policy of DiffusionNFT: a second copy of the transformer whose trainable weights
follow the policy's as an exponential moving average, old <- decay * old + (1 - decay) * new.
It samples the rollouts and gives v_old. With decay 0 it equals the policy.

Works on FSDP2-sharded models as well as plain ones: both copies are sharded the same way, so
the update is elementwise on each rank's local shards.
"""
from __future__ import annotations

import torch


def trainable_pairs(policy: torch.nn.Module, old: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(policy param, old param) for every trainable parameter, matched by name."""
    old_params = dict(old.named_parameters())
    pairs = []
    for name, param in policy.named_parameters():
        if not param.requires_grad:
            continue
        if name not in old_params:
            raise KeyError(f"the EMA copy has no parameter {name!r}; it must be built like the policy")
        pairs.append((param, old_params[name]))
    return pairs


@torch.no_grad()
def ema_update(policy: torch.nn.Module, old: torch.nn.Module, decay: float) -> None:
    """old = decay * old + (1 - decay) * policy, over the trainable parameters."""
    if not 0 <= decay < 1:
        raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
    for param, old_param in trainable_pairs(policy, old):
        if decay == 0:
            old_param.copy_(param.detach())
        else:
            old_param.lerp_(param.detach(), 1.0 - decay)


@torch.no_grad()
def copy_weights(policy: torch.nn.Module, old: torch.nn.Module) -> None:
    """old = policy over the trainable parameters."""
    for param, old_param in trainable_pairs(policy, old):
        old_param.copy_(param.detach())

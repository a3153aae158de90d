"""Wan 2.2's two experts as the one trainable module of the `wan` family (stages/models/wan.py)."""
from __future__ import annotations

from typing import Any

import torch


class WanExperts(torch.nn.Module):
    """Wan 2.2's two experts as one module: `transformer` for timesteps >= `boundary` (high noise),
    `transformer_2` below. Called like one WanTransformer3DModel."""

    def __init__(self, transformer: Any, transformer_2: Any, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, float(boundary)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def config(self) -> Any:
        return self.transformer.config

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False) -> tuple[torch.Tensor]:
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        high = t >= self.boundary
        if bool(high.all()) or bool((~high).all()):  # every step of a sampler: one expert for the batch
            expert = self.transformer if bool(high.all()) else self.transformer_2
            out = expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         return_dict=False)[0]
            return (out + self._idle(self.transformer_2 if expert is self.transformer else self.transformer,
                                     hidden_states, timestep, encoder_hidden_states),)
        out = torch.empty_like(hidden_states, dtype=torch.float32)
        for expert, mask in ((self.transformer, high), (self.transformer_2, ~high)):
            idx = mask.nonzero().flatten()
            v = expert(hidden_states=hidden_states[idx], timestep=timestep[idx], encoder_hidden_states=encoder_hidden_states[idx],
                       return_dict=False)[0]
            out = out.index_put((idx,), v.float())
        return (out.to(hidden_states.dtype),)

    @staticmethod
    def _idle(expert: Any, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> Any:
        """Under FSDP2 with several ranks every rank must run both experts (their parameters are
        gathered and their gradients reduced collectively), also when none of its samples is in
        one expert's range: a one-sample pass whose output enters with weight 0. One process: 0."""
        import torch.distributed as dist  # start-up time: torch loads on first use, not when a recipe is read

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return 0
        return 0 * expert(hidden_states=x[:1], timestep=t[:1], encoder_hidden_states=text[:1], return_dict=False)[0].sum()

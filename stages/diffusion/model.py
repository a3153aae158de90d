"""Binding a flow family's velocity (of the policy, the EMA old policy or the reference) and a batch
of prompts into a `Velocity`, the callable the sampler and the losses use; and the prompt
conditioning those need, each prompt encoded once, on its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from unirl.stages.diffusion.sampling import Velocity


@dataclass
class Conditions:
    """The batched conditioning of some prompts: `cond`, a tuple of (B, ...) tensors in the
    family's order (SD3: embeds, pooled); `neg`, the negative prompt's, for CFG."""

    cond: tuple[Tensor, ...]
    neg: tuple[Tensor, ...] | None = None


class PromptCache:
    """Prompt -> the family's conditioning from its frozen text encoders, each prompt encoded alone
    (batch of one), so its conditioning is the same bits whatever batch it later appears in:
    sampling and training see identical conditioning, also after a worker restart. Prompts repeat
    within a group and across iterations, so most lookups are free."""

    def __init__(self, family: Any, bundle: Any, max_size: int = 4096):
        self.family, self.bundle, self.max_size = family, bundle, max_size
        self._cache: dict[str, tuple[Tensor, ...]] = {}

    def _one(self, prompt: str) -> tuple[Tensor, ...]:
        hit = self._cache.get(prompt)
        if hit is None:
            if len(self._cache) >= self.max_size:
                self._cache.clear()
            hit = self._cache[prompt] = tuple(self.family.encode_prompt(self.bundle, prompt))
        return hit

    def __call__(self, prompts: list[str], sampler: Any) -> Conditions:
        """Conditioning of `prompts`; the sampler's negative prompt too when it uses CFG (a
        guidance-distilled family takes the scale as an input and needs none)."""
        pairs = [self._one(p) for p in prompts]
        out = Conditions(tuple(torch.stack([c[i] for c in pairs]) for i in range(len(pairs[0]))))
        if sampler.guidance_scale > 1 and self.family.uses_cfg(self.bundle):
            out.neg = tuple(t.expand(len(prompts), *t.shape) for t in self._one(sampler.negative_prompt))
        return out


def bind(family: Any, bundle: Any, conditions: Conditions, guidance_scale: float, module: Any = None) -> Velocity:
    """v(x, sigma) of `module` (default: the bundle's trainable module) for `conditions`."""
    module = bundle.module if module is None else module

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        return family.velocity(bundle, module, x, sigma, conditions.cond, guidance_scale, conditions.neg)

    return velocity

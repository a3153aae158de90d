"""Binding an SD3 bundle's transformer (the policy, the EMA old policy or the reference) and a
batch of prompts into a `Velocity`, the callable the sampler and the losses use; and the prompt
embeddings those need, each prompt encoded once, on its own."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from stages.diffusion.sampling import Velocity
from stages.models.sd3 import PromptEmbeds, SD3Bundle, encode_prompts, predict_velocity


class PromptCache:
    """Prompt -> embeddings of the frozen text encoders, each prompt encoded alone (batch of
    one), so its embedding is the same bits whatever batch it later appears in: sampling and
    training see identical conditioning, also after a worker restart. Prompts repeat within a
    group and across iterations, so most lookups are free."""

    def __init__(self, bundle: SD3Bundle, max_size: int = 4096):
        self.bundle = bundle
        self.max_size = max_size
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}

    def _one(self, prompt: str) -> tuple[Tensor, Tensor]:
        hit = self._cache.get(prompt)
        if hit is None:
            if len(self._cache) >= self.max_size:
                self._cache.clear()
            e = encode_prompts(self.bundle, [prompt])
            hit = self._cache[prompt] = (e.embeds[0], e.pooled[0])
        return hit

    def __call__(self, prompts: list[str], sampler: Any) -> PromptEmbeds:
        """Embeddings of `prompts`; the sampler's negative prompt too when it uses CFG."""
        pairs = [self._one(p) for p in prompts]
        out = PromptEmbeds(torch.stack([e for e, _ in pairs]), torch.stack([p for _, p in pairs]))
        if sampler.guidance_scale > 1:
            neg, neg_pooled = self._one(sampler.negative_prompt)
            out.neg_embeds = neg.expand(len(prompts), *neg.shape)
            out.neg_pooled = neg_pooled.expand(len(prompts), *neg_pooled.shape)
        return out


def encode(bundle: SD3Bundle, prompts: list[str], sampler: Any) -> PromptEmbeds:
    """Prompt embeddings for the sampler's guidance (negative prompt only with CFG), uncached."""
    negative = sampler.negative_prompt if sampler.guidance_scale > 1 else None
    return encode_prompts(bundle, list(prompts), negative_prompt=negative)


def bind(bundle: SD3Bundle, embeds: PromptEmbeds, guidance_scale: float, transformer: Any = None) -> Velocity:
    """v(x, sigma) of `transformer` (default: the bundle's) for the prompts of `embeds`."""
    if transformer is not None and transformer is not bundle.transformer:
        bundle = dataclasses.replace(bundle, transformer=transformer)

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        n = x.shape[0]
        return predict_velocity(
            bundle, x, sigma, embeds.embeds[:n], embeds.pooled[:n], guidance_scale=guidance_scale,
            neg_embeds=None if embeds.neg_embeds is None else embeds.neg_embeds[:n],
            neg_pooled=None if embeds.neg_pooled is None else embeds.neg_pooled[:n],
        )

    return velocity

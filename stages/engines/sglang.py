"""`sglang`: a running SGLang server (its own process and Python environment: SGLang's wheel pins
its own torch and transformers) reached over its native HTTP API (stages/engines/client.py; the
launch commands are in docs/engines.md). Text models: /generate with return_logprob, weights from
disk under a weight_version, LoRA adapters hot-loaded (`--enable-lora`). Flow models: SGLang
diffusion's /rollout/generate.

SGLang's kernels and precision are not the trainer's, so its behaviour log-probs differ from the
trainer's replay even with the same weights: the on-policy check is off by default (tolerance
inf; `rollout.behaviour_tolerance` sets one) and `rollout.correction` is required. It needs CUDA:
on CPU machines its client is contract-tested against SGLang's released source
(tests/stages/engines/test_sglang_contract.py).
"""
from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field

from unirl.stages.engines.client import EngineClient
from unirl.stages.engines.dedicated import DedicatedConfig, DedicatedEngine
from unirl.stages.runtime.registry import algorithms, engines, kernels


class SGLangConfig(DedicatedConfig):
    """A running SGLang server (docs/engines.md for its launch command)."""

    name: Literal["sglang"] = Field("sglang", description="Rollout engine.")
    url: str = Field(description="http://host:port of the SGLang server (`python -m sglang.launch_server ...`).")
    token_env: str = Field("SGLANG_API_KEY", description="Variable holding the server's --api-key (empty: no key).")


@engines.register("sglang")
class SGLang(DedicatedEngine):
    name = "sglang"
    config = SGLangConfig
    behaviour_tolerance = math.inf
    # other kernels than the trainer's: log-probs agree to ~1e-6 in fp32 (vLLM, CPU), less in bf16
    canary_tolerances = {"float32": 1e-3, "bfloat16": 5e-2}

    @classmethod
    def check(cls, recipe: Any) -> None:
        super().check(recipe)
        # Text losses correct with importance weights; flow losses anchor on the recorded
        # per-step log-probs themselves (their behaviour check is off here too), and take a
        # correction only for rows of older versions (sync.every > 1, async: DedicatedEngine.check).
        algo = algorithms.get(recipe.algorithm.name)
        if recipe.rollout.correction is None and algo.correction_levels and not algo.replays_transitions:
            raise ValueError("rollout.correction: SGLang's kernels and precision differ from the trainer's, so its "
                             "behaviour log-probs do too; set rollout.correction (e.g. `correction: {}`)")
        sampler = getattr(recipe.rollout, "sampler", None)
        if sampler is not None:
            if kernels.get(sampler.kernel).sglang is None:
                raise ValueError(f"rollout.sampler.sde_kind: SGLang's /rollout/generate has no {sampler.kernel} kernel "
                                 f"({', '.join(k.sglang for _, k in kernels.items() if k.sglang)}); use engine_server or "
                                 "another algorithm")
            if sampler.init_same_noise and recipe.rollout.group_size > 1:
                raise ValueError("rollout.sampler.init_same_noise: SGLang draws a sample's SDE noise from its seed, so "
                                 "one initial noise per group would make a group's samples identical; set "
                                 "init_same_noise: false")
            if recipe.rollout.engine.sync.weights == "lora":
                raise ValueError("rollout.engine.sync.weights: SGLang diffusion takes LoRA weights as tensors, not "
                                 "adapter folders; use sync.weights: full")

    def client(self, version: int) -> EngineClient:
        if self._client is None:
            token = os.environ.get(self.cfg.token_env) or None
            self._client = EngineClient(self.cfg.url, token, timeout_s=self.cfg.request_timeout_s, name="SGLang server")
            self._client.model_info()  # unreachable: a clear error naming the URL, before any work
        return self._client

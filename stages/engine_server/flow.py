"""Flow-model rollouts of the engine server: SGLang diffusion's POST /rollout/generate
(`RolloutRequest` -> a list of `RolloutResponse`, msgpack, tensors as safetensors bytes), sampled
with the flow policy's own pieces: its prompt conditioning and velocity (stages/policies/flow.py),
the sampling loop and SDE kernels (stages/diffusion/sampling.py, stages/diffusion/sde.py), the family's
decoder.

Replaying a stored transition gives the recorded log-prob bit for bit only when the velocity saw
the same batch (CPU kernels block differently for other batch sizes). unirl's client therefore
sends the requests of one trainer micro-batch together, marked
`extra_sampling_params.unirl_batch = {"id", "size", "index"}`, and the server samples them as one
batch in that order; unmarked requests are sampled alone. Also in `extra_sampling_params`:
`sde_seed` (the SDE noise's generator seed, default derived from `seed`) and `sde_kind` (a unirl
kernel SGLang does not have: `dance`).
"""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.stages.diffusion.kernels import ODE, kernels
from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.runtime.seeds import derive_seed

# SGLang's rollout_sde_type -> our SDE kernel (DESIGN.md section 5).
SDE_KINDS = {kernel.sglang: name for name, kernel in kernels.items() if kernel.sglang is not None}
SERVED = {"prompt", "negative_prompt", "seed", "generator_device", "width", "height", "num_inference_steps",
          "num_outputs_per_prompt", "guidance_scale", "rollout", "rollout_sde_type", "rollout_noise_level",
          "rollout_log_prob_no_const", "rollout_debug_mode", "rollout_return_denoising_env",
          "rollout_return_dit_trajectory", "rollout_sde_step_indices", "rollout_return_step_indices",
          "suppress_logs", "extra_sampling_params", "true_cfg_scale", "num_frames", "fps", "image_path"}


@dataclass
class FlowRequest:
    body: dict[str, Any]
    future: Future = field(default_factory=Future)

    @property
    def extra(self) -> dict[str, Any]:
        return self.body.get("extra_sampling_params") or {}


class FlowBackend:
    route = "/rollout/generate"

    @classmethod
    def serve(cls, core: EngineCore, *, max_batch: int, wait_s: float) -> FlowBackend:
        """Flow requests are batched by the trainer's micro-batches (their `rollout_batch` ids), not
        by a queue: `max_batch` and `wait_s` are the text backend's."""
        return cls(core)

    def __init__(self, core: EngineCore, *, batch_timeout_s: float = 120.0):
        self.core = core
        self.batch_timeout_s = batch_timeout_s
        self._waiting: dict[str, list[FlowRequest]] = {}
        self._lock = threading.Lock()
        self.batches = 0

    def submit(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        unknown = sorted(k for k, v in body.items() if k not in SERVED and v is not None)
        if unknown:
            raise EngineRequestError(f"RolloutRequest fields {unknown} are not served by the engine server")
        if not body.get("prompt") and body.get("prompt") != "":
            raise EngineRequestError("RolloutRequest.prompt is required")
        req = FlowRequest(body)
        batch = req.extra.get("unirl_batch")
        if batch is None:
            self._run([req])
        else:
            key, size = str(batch["id"]), int(batch["size"])
            with self._lock:
                group = self._waiting.setdefault(key, [])
                group.append(req)
                complete = len(group) == size
                if complete:
                    del self._waiting[key]
            if complete:
                self._run(sorted(group, key=lambda r: int(r.extra["unirl_batch"]["index"])))
        return req.future.result(timeout=self.batch_timeout_s)

    def _run(self, batch: list[FlowRequest]) -> None:
        try:
            self._sample(batch)
        except Exception as exc:  # noqa: BLE001 - every member of the batch gets the error
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)

    def _plan(self, body: dict[str, Any], policy: Any) -> Any:
        from unirl.stages.diffusion.sampling import Plan
        from unirl.stages.diffusion.sde import dynamic_shift, shifted_sigmas, time_shift_sigmas

        sampler = policy.sampler
        steps = int(body.get("num_inference_steps") or sampler.num_steps)
        if sampler.dynamic_shift:
            sigmas = time_shift_sigmas(steps, dynamic_shift(policy.family.latent_tokens(policy.bundle, policy.shape)))
        else:
            sigmas = shifted_sigmas(steps, sampler.shift)
        kind = body.get("extra_sampling_params", {}).get("sde_kind") if body.get("extra_sampling_params") else None
        sde_type = body.get("rollout_sde_type", "sde")
        if kind is None:
            if sde_type not in SDE_KINDS:
                raise EngineRequestError(f"rollout_sde_type {sde_type!r} (served: {', '.join(SDE_KINDS)})")
            kind = SDE_KINDS[sde_type]
        if kind not in kernels:
            raise EngineRequestError(f"extra_sampling_params.sde_kind {kind!r} (served: {', '.join(kernels.names())})")
        eta = float(body.get("rollout_noise_level", 0.7))
        if not body.get("rollout", True) or kernels.get(kind).deterministic or eta == 0:
            return Plan(sigmas, torch.zeros(0, dtype=torch.long), ODE, 0.0)
        indices = body.get("rollout_sde_step_indices")
        indices = list(range(steps)) if indices is None else sorted(int(i) for i in indices)
        if any(not 0 <= i < steps for i in indices):
            raise EngineRequestError(f"rollout_sde_step_indices {indices} outside [0, {steps})")
        return Plan(sigmas, torch.tensor(indices, dtype=torch.long), kind, eta)

    def _sample(self, batch: list[FlowRequest]) -> None:
        from unirl.stages.diffusion.sampling import sample
        from unirl.stages.runtime.faults import fault_point

        core = self.core
        core.wait_running()
        fault_point("engine-generate", owner=False)  # the engine killed mid-generate (benchmarks/faults.py)
        start = time.perf_counter()
        with core.lock:
            policy = core.policy
            first = batch[0].body
            plan = self._plan(first, policy)
            for r in batch[1:]:
                other = self._plan(r.body, policy)
                if not (torch.equal(other.sigmas, plan.sigmas) and torch.equal(other.sde_indices, plan.sde_indices)
                        and other.kind == plan.kind):
                    raise EngineRequestError("requests of one unirl_batch must share steps and SDE settings")
            self._check_sampler(first, policy)
            prompts, x0, seeds, members = [], [], [], []
            for r in batch:
                n = int(r.body.get("num_outputs_per_prompt") or 1)
                seed = int(r.body["seed"]) if r.body.get("seed") is not None else uuid.uuid4().int % (2**31)
                for i in range(n):
                    prompts.append(r.body["prompt"])
                    generator = torch.Generator().manual_seed(seed + i)  # SGLang: output i of a prompt uses seed + i
                    x0.append(torch.randn(tuple(policy.shape), generator=generator, dtype=torch.float32))
                    sde_seed = r.extra.get("sde_seed")
                    seeds.append(int(sde_seed) + i if sde_seed is not None else derive_seed(seed + i, "sde"))
                    members.append((r, seed + i))
            steps = plan.num_steps
            want = first.get("rollout_return_step_indices")
            store = sorted({int(i) for i in (want if want is not None else range(steps))} | {steps})
            traj = sample(policy.velocity(core.module, prompts), torch.stack(x0).to(core.device), plan, seeds, store=store)
            images = policy.decode(traj.final)
            self.batches += 1
        logprobs = torch.zeros(len(prompts), steps)
        if traj.logprobs.shape[1]:
            logprobs[:, plan.sde_indices] = traj.logprobs.cpu()
        elapsed = time.perf_counter() - start
        by_request: dict[int, list[dict[str, Any]]] = {}
        for b, (r, seed) in enumerate(members):
            by_request.setdefault(id(r), []).append({
                "request_id": uuid.uuid4().hex, "prompt": r.body["prompt"], "seed": seed,
                "generated_output": torch.as_tensor(images[b]),
                "rollout_log_probs": logprobs[b] if r.body.get("rollout", True) else None,
                "rollout_debug_tensors": None, "denoising_env": None,
                "dit_trajectory": {"latents": traj.latents[b].cpu(), "timesteps": plan.sigmas[:-1] * 1000,
                                   "sigmas": plan.sigmas} if r.body.get("rollout_return_dit_trajectory") else None,
                "inference_time_s": elapsed, "peak_memory_mb": None,
            })
        for r in batch:
            r.future.set_result(by_request[id(r)])

    @staticmethod
    def _check_sampler(body: dict[str, Any], policy: Any) -> None:
        """Guidance and the negative prompt are the served recipe's (its conditioning is cached
        per prompt); a request asking for others is refused rather than silently ignored."""
        sampler = policy.sampler
        gs = body.get("guidance_scale")
        if gs is not None and float(gs) != float(sampler.guidance_scale):
            raise EngineRequestError(f"guidance_scale {gs}: this engine serves {sampler.guidance_scale} (its recipe)")
        neg = body.get("negative_prompt")
        if neg is not None and neg != sampler.negative_prompt:
            raise EngineRequestError(f"negative_prompt {neg!r}: this engine serves {sampler.negative_prompt!r}")
        for side in ("width", "height"):
            if body.get(side) is not None and int(body[side]) != policy.image_size:
                raise EngineRequestError(f"{side} {body[side]}: this engine serves {policy.image_size}-pixel images")

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

import asyncio
import math
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool

from unirl.stages.diffusion.kernels import ODE
from unirl.stages.diffusion.sampling import Plan, sample
from unirl.stages.diffusion.sde import dynamic_shift, shifted_sigmas, time_shift_sigmas
from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.engines.limits import SEED_BOUND, Limits, integer, number, over, shown, text_field
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.registry import kernels
from unirl.stages.runtime.seeds import derive_seed

# SGLang's rollout_sde_type -> our SDE kernel (docs/architecture.md, "The math contract").
SDE_KINDS = {kernel.sglang: name for name, kernel in kernels.items() if kernel.sglang is not None}
SERVED = {"prompt", "negative_prompt", "seed", "generator_device", "width", "height", "num_inference_steps",
          "num_outputs_per_prompt", "guidance_scale", "rollout", "rollout_sde_type", "rollout_noise_level",
          "rollout_log_prob_no_const", "rollout_debug_mode", "rollout_return_denoising_env",
          "rollout_return_dit_trajectory", "rollout_sde_step_indices", "rollout_return_step_indices",
          "suppress_logs", "extra_sampling_params", "true_cfg_scale", "num_frames", "fps", "image_path"}


@dataclass
class FlowRequest:
    """A RolloutRequest checked: what it asks for, in the types the sampler takes."""

    body: dict[str, Any]
    steps: int
    kind: str  # the SDE kernel, ODE for a deterministic request
    eta: float
    sde_indices: tuple[int, ...]
    store: tuple[int, ...]  # steps whose x is kept (always the last)
    outputs: int
    seed: int
    sde_seed: int | None
    batch: tuple[str, int, int] | None  # unirl_batch (id, size, index)
    future: Future = field(default_factory=Future)

    @property
    def settings(self) -> tuple[Any, ...]:
        """What every request of one sampled batch shares."""
        return self.steps, self.kind, self.eta, self.sde_indices, self.store


def batch_of(req: FlowRequest) -> tuple[str, int, int]:
    """The (id, size, index) of a request that came as a member of a client-declared batch."""
    assert req.batch is not None, "only batch members wait for their batch"
    return req.batch


class FlowBackend:
    route = "/rollout/generate"

    @classmethod
    def serve(cls, core: EngineCore, *, max_batch: int, wait_s: float, limits: Limits) -> FlowBackend:
        """Flow requests are batched by the trainer's micro-batches (their `unirl_batch` ids), not
        by a queue: `wait_s` is the text backend's; `max_batch` bounds the outputs of one batch."""
        return cls(core, max_batch=max_batch, limits=limits)

    def __init__(self, core: EngineCore, *, max_batch: int, limits: Limits, batch_timeout_s: float = 120.0):
        self.core, self.max_batch, self.limits = core, max_batch, limits
        self.batch_timeout_s = batch_timeout_s
        # the recipe's sampling, fixed for the server's life (weight updates keep it), read without the weights
        policy = core.policy
        self.sampler, self.image_size, self.num_frames = policy.sampler, policy.image_size, policy.num_frames
        self._waiting: dict[str, list[FlowRequest]] = {}
        self._lock = threading.Lock()
        self.batches = 0

    async def submit(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The request's outputs, once its batch (its `unirl_batch`, or itself alone) is sampled.
        A member waiting for the rest of its batch awaits without holding one of the server's worker
        threads: they are finite (anyio's 40), and members of several batches that each held one
        could fill them all while every batch waits for a member that cannot get a thread (seen:
        four batches of 32 from one async producer, a 120 s stall)."""
        req = await run_in_threadpool(self.check, body)
        if req.batch is None:
            await run_in_threadpool(self._run, [req])
            return req.future.result()
        complete = self._join(req)
        if complete is not None:
            await run_in_threadpool(self._run, complete)
        answer = asyncio.wrap_future(req.future)
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout=self.batch_timeout_s)
        except asyncio.TimeoutError:
            self._expire(req)
            return await answer  # an error now, or the outputs when it completed meanwhile (being sampled)

    def _join(self, req: FlowRequest) -> list[FlowRequest] | None:
        """Add a batch member to its batch; the whole batch, in index order, when this completes it."""
        key, size, index = batch_of(req)
        with self._lock:
            group = self._waiting.setdefault(key, [])
            if group and (size != batch_of(group[0])[1] or group[0].settings != req.settings):
                raise EngineRequestError(f"unirl_batch {shown(key)}: its requests must share size, steps, SDE settings "
                                         "and returned steps")
            if any(batch_of(r)[2] == index for r in group):
                raise EngineRequestError(f"unirl_batch {shown(key)}: index {index} was sent already")
            group.append(req)
            if len(group) < size:
                return None
            del self._waiting[key]
        return sorted(group, key=lambda r: batch_of(r)[2])

    def _expire(self, req: FlowRequest) -> None:
        """A batch still incomplete after batch_timeout_s: every member that came is answered an error."""
        key, size, _ = batch_of(req)
        with self._lock:
            group = self._waiting.get(key)
            if group is not None and req in group:
                del self._waiting[key]
                for r in group:
                    r.future.set_exception(EngineRequestError(
                        f"unirl_batch {shown(key)}: {len(group)} of its {size} requests arrived within "
                        f"{self.batch_timeout_s:.0f}s; send all of them"))

    def check(self, body: dict[str, Any]) -> FlowRequest:
        """The request's fields checked against the served recipe and the server's limits before it
        joins a batch: a bad request is refused alone."""
        unknown = sorted(k for k, v in body.items() if k not in SERVED and v is not None)
        if unknown:
            raise EngineRequestError(f"RolloutRequest fields {unknown[:5]} are not served by the engine server")
        if not isinstance(body.get("prompt"), str):
            raise EngineRequestError("RolloutRequest.prompt is required (a string)")
        self._check_sampler(body)
        extra = body.get("extra_sampling_params") or {}
        if not isinstance(extra, dict):
            raise EngineRequestError("extra_sampling_params must be an object")
        steps = integer(body.get("num_inference_steps") or self.sampler.num_steps, "num_inference_steps", 1, 1 << 62)
        if steps > self.limits.max_steps:
            raise over("num_inference_steps", steps, "max_steps", self.limits.max_steps)
        kind, eta, indices = self._sde(body, extra, steps)
        want = body.get("rollout_return_step_indices")
        if want is None:
            want = range(steps)
        elif not isinstance(want, list):
            raise EngineRequestError("rollout_return_step_indices must be a list of steps")
        store = tuple(sorted({integer(i, "rollout_return_step_indices", 0, steps + 1) for i in want} | {steps}))
        outputs = integer(body.get("num_outputs_per_prompt") or 1, "num_outputs_per_prompt", 1, 1 << 62)
        seed, sde_seed = body.get("seed"), extra.get("sde_seed")
        seed = uuid.uuid4().int % (2**31) if seed is None else integer(seed, "seed", 0, SEED_BOUND)
        sde_seed = None if sde_seed is None else integer(sde_seed, "extra_sampling_params.sde_seed", 0, SEED_BOUND)
        batch = extra.get("unirl_batch")
        if batch is not None:
            if not isinstance(batch, dict):
                raise EngineRequestError("extra_sampling_params.unirl_batch must be {id, size, index}")
            size = integer(batch.get("size"), "unirl_batch.size", 1, 1 << 62)
            batch = (text_field(batch.get("id"), "unirl_batch.id"), size, integer(batch.get("index"), "unirl_batch.index", 0, size))
        size = batch[1] if batch is not None else 1
        if outputs * size > self.max_batch:
            raise over("outputs sampled in one batch (num_outputs_per_prompt x unirl_batch.size)", outputs * size,
                       "max_batch", self.max_batch, 413)
        return FlowRequest(body, steps, kind, eta, indices, store, outputs, seed, sde_seed, batch)

    def _sde(self, body: dict[str, Any], extra: dict[str, Any], steps: int) -> tuple[str, float, tuple[int, ...]]:
        """(kernel, eta, SDE steps) of a request; (ODE, 0.0, ()) when it samples deterministically."""
        kind = extra.get("sde_kind")
        if kind is None:
            sde_type = body.get("rollout_sde_type", "sde")
            if not isinstance(sde_type, str) or sde_type not in SDE_KINDS:
                raise EngineRequestError(f"rollout_sde_type {shown(sde_type)} (served: {', '.join(SDE_KINDS)})")
            kind = SDE_KINDS[sde_type]
        if not isinstance(kind, str) or kind not in kernels:
            raise EngineRequestError(f"extra_sampling_params.sde_kind {shown(kind)} (served: {', '.join(kernels.names())})")
        eta = number(body.get("rollout_noise_level", 0.7), "rollout_noise_level", 0.0, math.inf)
        if not body.get("rollout", True) or kernels.get(kind).deterministic or eta == 0:
            return ODE, 0.0, ()
        indices = body.get("rollout_sde_step_indices")
        if indices is None:
            return kind, eta, tuple(range(steps))
        if not isinstance(indices, list):
            raise EngineRequestError("rollout_sde_step_indices must be a list of steps")
        return kind, eta, tuple(sorted(integer(i, f"rollout_sde_step_indices (of {steps} steps)", 0, steps) for i in indices))

    def _run(self, batch: list[FlowRequest]) -> None:
        try:
            self._sample(batch)
        except Exception as exc:  # noqa: BLE001 - every member of the batch gets the error
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)

    def _plan(self, r: FlowRequest, policy: Any) -> Any:
        if self.sampler.dynamic_shift:
            sigmas = time_shift_sigmas(r.steps, dynamic_shift(policy.family.latent_tokens(policy.bundle, policy.shape)))
        else:
            sigmas = shifted_sigmas(r.steps, self.sampler.shift)
        return Plan(sigmas, torch.tensor(r.sde_indices, dtype=torch.long), r.kind, r.eta)

    def _sample(self, batch: list[FlowRequest]) -> None:
        core = self.core
        core.wait_running()
        fault_point("engine-generate", owner=False)  # the engine killed mid-generate (benchmarks/faults.py)
        start = time.perf_counter()
        with core.lock:
            policy = core.policy
            first = batch[0]
            plan = self._plan(first, policy)
            prompts, x0, seeds, members = [], [], [], []
            for r in batch:
                for i in range(r.outputs):
                    prompts.append(r.body["prompt"])
                    generator = torch.Generator().manual_seed(r.seed + i)  # SGLang: output i of a prompt uses seed + i
                    x0.append(torch.randn(tuple(policy.shape), generator=generator, dtype=torch.float32))
                    seeds.append(r.sde_seed + i if r.sde_seed is not None else derive_seed(r.seed + i, "sde"))
                    members.append((r, r.seed + i))
            steps = plan.num_steps
            traj = sample(policy.velocity(core.module, prompts), torch.stack(x0).to(core.device), plan, seeds, store=list(first.store))
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

    def _check_sampler(self, body: dict[str, Any]) -> None:
        """Guidance, the negative prompt and the media's size are the served recipe's (its
        conditioning is cached per prompt); a request asking for others is refused rather than
        silently ignored."""
        sampler = self.sampler
        gs = body.get("guidance_scale")
        if gs is not None and number(gs, "guidance_scale", -math.inf, math.inf) != float(sampler.guidance_scale):
            raise EngineRequestError(f"guidance_scale {gs}: this engine serves {sampler.guidance_scale} (its recipe)")
        neg = body.get("negative_prompt")
        if neg is not None and neg != sampler.negative_prompt:
            raise EngineRequestError(f"negative_prompt {shown(neg)}: this engine serves {sampler.negative_prompt!r}")
        for side in ("width", "height"):
            if body.get(side) is not None and body[side] != self.image_size:
                raise EngineRequestError(f"{side} {shown(body[side])}: this engine serves {self.image_size}-pixel images")
        frames = body.get("num_frames")
        if frames is not None and frames != self.num_frames:
            raise EngineRequestError(f"num_frames {shown(frames)}: this engine serves {self.num_frames or 'no'} frames (its recipe)")

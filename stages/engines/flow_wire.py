"""Flow-model rollouts through SGLang diffusion's /rollout/generate: one `RolloutRequest` per
sample (its prompt, the seed of its initial noise derived as trainside derives it, the
iteration's SDE steps and noise level), and each `RolloutResponse` (the denoising trajectory at
the steps training needs, per-step log-probs, the image) mapped onto the latent segment of a row.
RolloutResponse carries no weight version: the engine stamps the rows with the
version /model_info reports around the batch.

Exact replay (engine_server): the trainer replays a micro-batch's velocity in one batch, and CPU
kernels give other bits for other batch compositions, so the requests of each trainer micro-batch
(the train stack's own cut, `micro_batches`) go together marked as one `unirl_batch`, with the
SDE noise seed alongside. The recorded log-probs are then the trainer's replay bit for bit.
"""
from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from unirl.stages.engines.client import EngineClient, EngineError, tensor_from_wire
from unirl.stages.runtime.accumulation import version_of
from unirl.stages.runtime.media import media_columns, media_counts
from unirl.stages.runtime.registry import kernels
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.runtime.seeds import derive_seed as seed_of

if TYPE_CHECKING:
    import numpy as np
    import torch

# Our SDE kernel -> SGLang's rollout_sde_type (a kernel SGLang lacks is sent as an extra).
SDE_TYPES = {name: kernel.sglang for name, kernel in kernels.items() if kernel.sglang is not None}


def media_uint8(media: torch.Tensor) -> np.ndarray:
    """(H, W, 3) or, a video, (F, H, W, 3) uint8 from an engine's decoded sample: uint8 channels
    last as ours, or float in [0, 1] channels first (CHW, FCHW)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    x = media.detach().cpu()
    if x.dtype != torch.uint8:
        x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
    if x.ndim in (3, 4) and x.shape[-3] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.movedim(-3, -1)
    return x.numpy()


class FlowWire:
    segment = "latent"
    reports_version = False  # SGLang diffusion has no weight_version: the client's own, checksum-verified

    @classmethod
    def for_engine(cls, engine: Any) -> FlowWire:
        """The wire of a dedicated engine: exact when the engine replays as the trainer does."""
        return cls(engine.recipe, exact=engine.exact_replay)

    def __init__(self, recipe: Any, *, exact: bool):
        self.recipe = recipe
        self.exact = exact

    def rollout(self, client: EngineClient, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, lora: str | None, transitions: bool) -> list[dict[str, Any]]:
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.sampling import Plan, make_plan, stored_steps
        from unirl.stages.diffusion.trajectory import latent_rows
        from unirl.stages.train.stack import micro_batches  # start-up time: it loads torch

        sampler, t = self.recipe.rollout.sampler, self.recipe.train
        # The SDE steps of the iteration's update (FlowPolicy.plan; the sigmas are the engine's, the trainer checks them).
        plan = make_plan(sampler, seed=self.recipe.seed, iteration=version_of(self.recipe, iteration), latent_tokens=1,
                         deterministic=greedy)
        store = stored_steps(plan.sde_indices.tolist(), plan.num_steps, transitions=transitions and not greedy)
        base = seed_of(self.recipe.seed, seed_tag)
        requests = []
        for sid, gid, prompt, _ in samples:
            noise_seed = seed_of(base, "group", gid, sep=":") if sampler.init_same_noise else seed_of(base, "sample", sid, sep=":")
            body = {
                "prompt": prompt, "seed": noise_seed, "num_outputs_per_prompt": 1, "num_inference_steps": plan.num_steps,
                "guidance_scale": sampler.guidance_scale, "rollout": True,
                "rollout_sde_type": SDE_TYPES.get(plan.kind, "sde"), "rollout_noise_level": plan.eta if plan.stochastic else sampler.eta,
                "rollout_log_prob_no_const": not plan.stochastic, "rollout_debug_mode": False,
                "rollout_return_dit_trajectory": True,
                "rollout_sde_step_indices": [int(i) for i in plan.sde_indices],
                "rollout_return_step_indices": [s for s in store if s < plan.num_steps],
            }
            if sampler.guidance_scale > 1:
                body["negative_prompt"] = sampler.negative_prompt
            if sampler.image_size is not None:
                body["width"] = body["height"] = sampler.image_size
            if self.exact:
                body["extra_sampling_params"] = {"sde_seed": derive_seed(self.recipe.seed, seed_tag, "sde", iteration, sid)}
                if plan.kind not in SDE_TYPES:
                    body["extra_sampling_params"]["sde_kind"] = plan.kind
            requests.append(body)
        if self.exact:  # the trainer's micro-batches, rank by rank: one engine batch each
            index = {sid: i for i, (sid, _, _, _) in enumerate(samples)}
            for rank in range(t.world_size):
                share = [s[0] for s in samples][rank::t.world_size]
                for group in micro_batches(share, t.micro_batch_size, t.updates_per_batch):
                    for chunk in group:
                        key = uuid.uuid4().hex
                        for j, sid in enumerate(chunk):
                            requests[index[sid]]["extra_sampling_params"]["unirl_batch"] = {"id": key, "size": len(chunk), "index": j}
        with ThreadPoolExecutor(max(1, min(64, len(requests)))) as pool:
            answers = list(pool.map(client.rollout_generate, requests))
        rows = []
        for (sid, gid, prompt, meta), body, answer in zip(samples, requests, answers):
            where = f"rollout engine at {client.url}, sample {sid!r}"
            if not answer:
                raise EngineError(f"{where}: /rollout/generate returned no output")
            out = tensor_from_wire(answer[0])
            traj = out.get("dit_trajectory") or {}
            latents, sigmas = traj.get("latents"), traj.get("sigmas")
            if latents is None or sigmas is None:
                raise EngineError(f"{where}: no dit_trajectory latents/sigmas in the answer")
            if latents.shape[0] != len(store):
                raise EngineError(f"{where}: {latents.shape[0]} trajectory latents, expected the {len(store)} steps {store}")
            logprobs = out.get("rollout_log_probs")
            k = plan.sde_indices
            step_lp = logprobs.float()[k].reshape(1, -1) if plan.stochastic else torch.zeros(1, 0)
            seg = latent_rows(latents.float()[None], step_lp,
                              Plan(sigmas.float(), plan.sde_indices, plan.kind, plan.eta))[0]
            rows.append({"sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt,
                         "noise_seed": int(body["seed"]), **media_columns(media_uint8(out["generated_output"])[None])[0],
                         **seg})
        return rows

    @staticmethod
    def counters(rows: list[dict[str, Any]]) -> dict[str, int]:
        return media_counts(rows)

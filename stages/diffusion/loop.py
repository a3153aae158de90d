"""The whole diffusion RL iteration in one process, on plain tensors: no Prefect, no storage, no
worker group, no FSDP. It does the same math as the flow (same prompts, seeds, micro-batches,
losses), so it is the floor the benchmark compares the flow against, and a quick way to try
hyperparameters from a notebook.

    loop = InProcessLoop(recipe, weights_dir)            # device="cuda" on a GPU; dtype: recipe.model.dtype
    for i in range(n): metrics = loop.iteration(i)
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from stages.advantage import group_advantages
from stages.diffusion import losses as L
from stages.diffusion.model import PromptCache, bind
from stages.diffusion.sampling import derive_seed, make_plan, sample, stored_steps
from stages.diffusion.trajectory import LatentBatch
from stages.sde import initial_noise
from stages.workers.ar_train import lr_factor


class InProcessLoop:
    def __init__(self, recipe: Any, weights_dir: str, *, lora: bool | None = None, device: str | torch.device = "cpu"):
        from stages.data import build_prompt_source
        from stages.models.sd3 import SD3_LORA_TARGETS, add_lora, latent_shape, load_sd3
        from stages.rewards.base import build_scorer
        from stages.workers.ar_train import EMA

        self.recipe = recipe
        torch.set_flush_denormal(True)  # as the worker does (tiny gradients make denormal Adam states)
        self.device = torch.device(device)
        self.bundle = load_sd3(weights_dir, dtype=getattr(torch, recipe.model.dtype), device=self.device)
        m, t = recipe.model, recipe.train
        if m.lora is not None:
            add_lora(self.bundle, rank=m.lora.rank, alpha=m.lora.alpha, target_modules=m.lora.target_modules or SD3_LORA_TARGETS)
        self.model = self.bundle.transformer
        self.reference = None
        if getattr(recipe.algorithm, "kl_coef", 0.0) > 0 and m.lora is None:  # frozen initial weights
            import copy

            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        self.ema = EMA(self.model, t.ema.decay) if t.ema else None
        self.opt_steps = 0
        self.prompts = PromptCache(self.bundle)
        self.source = build_prompt_source(recipe.data)
        self.scorers = [(build_scorer(s.name, **s.params), s.weight) for s in recipe.reward.scorers]
        size = recipe.rollout.sampler.image_size or self.bundle.default_image_size
        self.shape = latent_shape(self.bundle, size)

    def plan(self, iteration: int):
        c, h, w = self.shape
        p = self.bundle.patch_size
        return make_plan(self.recipe.rollout.sampler, seed=self.recipe.seed, iteration=iteration, latent_tokens=(h // p) * (w // p))

    def _old_weights(self):
        """Swap the EMA (old policy) in for NFT; returns a restore function."""
        if self.recipe.algorithm.name != "nft":
            return lambda: None
        backup = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in self.ema.shadow}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in backup:
                    p.copy_(self.ema.shadow[n])

        def restore() -> None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in backup:
                        p.copy_(backup[n])

        return restore

    def iteration(self, iteration: int) -> dict[str, float]:
        from stages.models.sd3 import decode_latents
        from stages.rewards.base import ScoreBatch

        r, algo, t = self.recipe.rollout, self.recipe.algorithm, self.recipe.train
        times: dict[str, float] = {}
        start = time.perf_counter()
        prompts = self.source.batch(iteration, r.prompts_per_iteration)
        samples = sorted(
            (f"iter-{iteration:06d}/{p.prompt_id}/{j}", f"iter-{iteration:06d}/{p.prompt_id}", p.text)
            for p in prompts for j in range(r.group_size)
        )
        plan = self.plan(iteration)
        likelihood = algo.name in L.LIKELIHOOD_ALGORITHMS
        store = stored_steps(plan.sde_indices.tolist(), plan.num_steps, transitions=likelihood)
        size = t.micro_batch_size
        chunks = [samples[i:i + size] for i in range(0, len(samples), size)]
        batches, images = [], []
        self.model.eval()
        restore = self._old_weights()
        for chunk in chunks:
            noise = torch.stack([initial_noise(self.shape, base_seed=derive_seed(self.recipe.seed, ""), group_id=g,
                                               sample_id=s, init_same_noise=r.sampler.init_same_noise)[0] for s, g, _ in chunk]).to(self.device)
            seeds = [derive_seed(self.recipe.seed, "", "sde", iteration, s) for s, _, _ in chunk]
            texts = [p for _, _, p in chunk]
            traj = sample(bind(self.bundle, self.prompts(texts, r.sampler), r.sampler.guidance_scale), noise, plan, seeds, store=store)
            images.append(decode_latents(self.bundle, traj.final).numpy())
            batches.append(LatentBatch([s for s, _, _ in chunk], texts, traj.latents, traj.logprobs, traj.stored, plan))
        restore()
        times["generate_s"] = time.perf_counter() - start

        start = time.perf_counter()
        flat = np.concatenate(images)
        batch = ScoreBatch(sample_ids=[s for s, _, _ in samples], prompts=[p for _, _, p in samples],
                           images=[im for im in flat])
        rewards = sum(w * np.asarray(scorer(batch).scores, dtype=np.float64) for scorer, w in self.scorers)
        a = self.recipe.advantage
        adv = group_advantages(rewards, [g for _, g, _ in samples], scope=a.scope, normalize=a.normalize,
                               use_global_std=a.use_global_std, eps=a.eps).float().to(self.device)
        times["score_s"] = time.perf_counter() - start

        start = time.perf_counter()
        self.model.train()
        updates = t.updates_per_batch
        bounds = [round(k * len(batches) / updates) for k in range(updates + 1)]
        frozen: dict[int, Any] = {}
        restore = self._old_weights()
        with torch.no_grad():
            for j, b in enumerate(batches):
                k = next(k for k in range(updates) if bounds[k] <= j < bounds[k + 1])
                velocity = bind(self.bundle, self.prompts(b.prompts, r.sampler), r.sampler.guidance_scale)
                if algo.name == "flow_dppo" and k > 0:
                    frozen[j] = L.transition_means(velocity, b)
                elif algo.name == "nft":
                    frozen[j] = [velocity(xt, tt) for tt, xt in L.nft_points(
                        b, seed=self.recipe.seed, iteration=iteration, update=k, draws=algo.timesteps)]
        restore()
        metrics: dict[str, float] = {}
        offset = 0
        for k in range(updates):
            total = sum(len(batches[j].sample_ids) for j in range(bounds[k], bounds[k + 1]))
            for j in range(bounds[k], bounds[k + 1]):
                b = batches[j]
                n = len(b.sample_ids)
                a_mb = adv[offset:offset + n]
                offset += n
                velocity = bind(self.bundle, self.prompts(b.prompts, r.sampler), r.sampler.guidance_scale)
                if algo.name == "nft":
                    m = L.nft_backward(algo, b, a_mb, velocity, frozen[j], weight=n / total, seed=self.recipe.seed,
                                       iteration=iteration, update=k)
                else:
                    ref = None
                    if self.reference is not None:
                        ref = bind(self.bundle, self.prompts(b.prompts, r.sampler), r.sampler.guidance_scale, self.reference)
                    elif getattr(algo, "kl_coef", 0) > 0:
                        from stages.models.sd3 import reference_policy

                        def ref(x, s, _v=velocity):
                            with reference_policy(self.bundle):
                                return _v(x, s)

                    m = L.likelihood_backward(algo, b, a_mb, velocity, weight=n / total, ref_velocity=ref,
                                              old_means=frozen.get(j), check_on_policy=k == 0)
                for key, value in m.items():
                    metrics[key] = metrics.get(key, 0.0) + value * n / len(samples)
            torch.nn.utils.clip_grad_norm_(self.trainable, t.max_grad_norm)
            factor = lr_factor(self.opt_steps, schedule=t.lr_schedule, warmup=t.warmup_steps,
                               total=self.recipe.iterations * updates, min_ratio=t.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = t.lr * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.decay = algo.ema_decay(self.opt_steps, t.ema.decay) if algo.name == "nft" else t.ema.decay
                self.ema.update(self.model)
            self.opt_steps += 1
        times["train_s"] = time.perf_counter() - start
        out = {f"train/{k}": v for k, v in metrics.items()}
        out.update({f"time/{k}": v for k, v in times.items()})
        out["rollout/reward_mean"] = float(rewards.mean())
        return out

"""What every rank of a diffusion worker group holds and does: the SD3 bundle whose transformer
is the FSDP2-sharded policy (blocks sharded, optionally with LoRA), frozen VAE and text encoders
replicated on every rank, AdamW with the recipe's lr schedule, the EMA old policy of NFT, and
the commands ping / generate / train / sft / save / publish (the interface of PolicyWorker).

Geometry: a rank's samples are the sorted sample ids [rank::world], cut into micro-batches of
`train.micro_batch_size`. Generation and training use the same cut, so the first update replays
exactly the batches that were sampled and its ratio is exactly 1 (checked). Ranks with fewer
micro-batches run a one-sample stand-in of weight 0 through the same code path, so every rank
issues the same FSDP2 collectives in the same order.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from stages.diffusion import losses as L
from stages.diffusion.export import merge_lora, write_sd3_folder
from stages.diffusion.model import PromptCache, bind
from stages.diffusion.sampling import derive_seed, make_plan, sample, stored_steps
from stages.diffusion.trajectory import LatentBatch, latent_rows, read_latents
from stages.recipe import Recipe
from stages.sample import join_on_sample_id, read_rollouts, read_shard, table_from_rows, write_shard
from stages.sde import SigmaMismatchError, check_sigmas, initial_noise
from stages.storage import join
from stages.workers.base import WorkerBase, shard
from stages.workers.ar_train import EMA, lr_factor

METRIC_KEYS = ("loss", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "ratio_min",
               "ratio_max", "kl", "drop_frac", "pos_mse", "neg_mse", "p_mean")


class DiffusionWorker(WorkerBase):
    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        from stages.models.sd3 import SD3_LORA_TARGETS, add_lora, check_image_size, load_sd3
        from stages.recipe_diffusion import check_diffusion_recipe

        check_diffusion_recipe(Recipe.model_validate(spec["recipe"]))
        # Policy-gradient steps make many tiny gradients; Adam's squared averages of those turn
        # denormal, and CPU kernels that touch denormals run many times slower.
        torch.set_flush_denormal(True)
        super().__init__(spec, mesh, device)
        m, t = self.recipe.model, self.recipe.train
        dtype = getattr(torch, m.dtype)
        self.bundle = load_sd3(self.base_dir, dtype=dtype, device=device)
        self.image_size = self.recipe.rollout.sampler.image_size or self.bundle.default_image_size
        check_image_size(self.bundle, self.image_size)  # before any compute
        self.prompts = PromptCache(self.bundle)
        self.lora = m.lora
        if self.lora is not None:
            add_lora(self.bundle, rank=self.lora.rank, alpha=self.lora.alpha,
                     target_modules=self.lora.target_modules or SD3_LORA_TARGETS)
        self.reference = None
        if getattr(self.recipe.algorithm, "kl_coef", 0.0) > 0 and self.lora is None:
            ref = load_sd3(self.base_dir, dtype=dtype, device=device).transformer.requires_grad_(False).eval()
            self.reference = shard(ref, list(ref.transformer_blocks), mesh)
        self.model = shard(self.bundle.transformer, list(self.bundle.transformer.transformer_blocks), mesh)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        self.ema = EMA(self.model, t.ema.decay) if t.ema else None
        self.restore(spec)

    # -- commands ---------------------------------------------------------------------------
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        from stages.models.sd3 import latent_shape

        return latent_shape(self.bundle, self.image_size)

    def plan(self, iteration: int, *, deterministic: bool = False):
        c, h, w = self.latent_shape
        tokens = (h // self.bundle.patch_size) * (w // self.bundle.patch_size)
        return make_plan(self.recipe.rollout.sampler, seed=self.recipe.seed, iteration=iteration,
                         latent_tokens=tokens, deterministic=deterministic)

    @contextmanager
    def old_policy(self) -> Iterator[None]:
        """NFT samples with, and regresses against, the EMA old policy: its weights swapped in."""
        if self.recipe.algorithm.name != "nft":
            yield
            return
        self._reshard()
        backup = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in self.ema.shadow}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in backup:
                    p.copy_(self.ema.shadow[n])
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in backup:
                        p.copy_(backup[n])

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters gathered after a forward; swap weights only on shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _micro_batches(self, items: list[Any]) -> tuple[list[list[Any]], int]:
        """This rank's share cut into micro-batches, and the most micro-batches any rank has."""
        size = self.recipe.train.micro_batch_size
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        count = torch.tensor([len(chunks)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return chunks, int(count)

    def _check_prompts(self, samples: list[tuple[str, str, str, Any]]) -> None:
        if not any(s.name == "geneval" for s in self.recipe.reward.scorers):
            return
        from stages.geneval import parse_prompt

        for sid, _, prompt, _ in samples:
            try:
                parse_prompt(prompt)
            except ValueError as exc:
                raise ValueError(f"sample {sid!r}: the geneval scorer cannot score this prompt: {exc}") from None

    def generate(self, iteration: int, requests: str, out_dir: str, greedy: bool = False, seed_tag: str = "",
                 use_ema: bool = False) -> dict[str, Any]:
        """Sample `group_size` images per request; each rank writes `out_dir/part-{rank:03d}.arrow`.
        greedy: the deterministic ODE sampler (evaluation)."""
        from stages.models.sd3 import decode_latents, to_png_bytes

        start = time.perf_counter()
        req = read_shard(self.storage, requests, "requests")
        samples = []
        for gid, prompt, meta, gsize in zip(req.column("group_id").to_pylist(), req.column("prompt").to_pylist(),
                                            req.column("metadata").to_pylist(), req.column("group_size").to_pylist()):
            samples += [(f"{gid}/{j}", gid, prompt, meta) for j in range(gsize)]
        samples.sort(key=lambda s: s[0])
        self._check_prompts(samples)
        sampler = self.recipe.rollout.sampler
        plan = self.plan(iteration, deterministic=greedy)
        likelihood = self.recipe.algorithm.name in L.LIKELIHOOD_ALGORITHMS
        store = stored_steps(plan.sde_indices.tolist(), plan.num_steps, transitions=likelihood and not greedy)
        chunks, count = self._micro_batches(samples[self.rank::self.world])
        shape = self.latent_shape
        rows = []
        self.model.eval()
        # NFT's rollouts come from the EMA old policy; evaluation (greedy) shows the policy itself.
        old = self.old_policy() if (self.recipe.algorithm.name == "nft" and not greedy) or use_ema else nullcontext()
        with old:
            for c in range(count):
                if c >= len(chunks):  # take part in the collectives only
                    velocity = bind(self.bundle, self.prompts([""], sampler), sampler.guidance_scale)
                    sample(velocity, torch.zeros(1, *shape, device=self.device), plan, [0], store=[plan.num_steps])
                    continue
                chunk = chunks[c]
                noises, noise_seeds = zip(*(
                    initial_noise(shape, base_seed=derive_seed(self.recipe.seed, seed_tag), group_id=gid, sample_id=sid,
                                  init_same_noise=sampler.init_same_noise)
                    for sid, gid, _, _ in chunk
                ))
                sde_seeds = [derive_seed(self.recipe.seed, seed_tag, "sde", iteration, sid) for sid, _, _, _ in chunk]
                velocity = bind(self.bundle, self.prompts([p for _, _, p, _ in chunk], sampler), sampler.guidance_scale)
                traj = sample(velocity, torch.stack(noises).to(self.device), plan, sde_seeds, store=store)
                pngs = to_png_bytes(decode_latents(self.bundle, traj.final))
                for (sid, gid, prompt, meta), seg, seed, png in zip(chunk, latent_rows(traj.latents, traj.logprobs, plan), noise_seeds, pngs):
                    rows.append({"sample_id": sid, "group_id": gid, "iteration": iteration, "policy_version": self.version,
                                 "parts": ["latent"], "metadata": meta, "prompt": prompt, "noise_seed": seed,
                                 "media_png": png, **seg})
        write_shard(self.storage, join(out_dir, f"part-{self.rank:03d}.arrow"), table_from_rows(rows, "rollouts", ["latent"]))
        total = torch.tensor([len(rows)], dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return {"files": [join(out_dir, f"part-{k:03d}.arrow") for k in range(self.world)], "rows": int(total),
                "images": int(total), "sde_steps": int(plan.sde_indices.numel()), "policy_version": self.version,
                "seconds": time.perf_counter() - start}

    # -- RL training ------------------------------------------------------------------------
    def _stand_in(self, batch: LatentBatch) -> LatentBatch:
        """A one-sample batch of zeros shaped like `batch` (weight 0: collectives only)."""
        return LatentBatch(["stand-in"], [""], torch.zeros_like(batch.latents[:1]), torch.zeros_like(batch.logprobs[:1]),
                           batch.stored, batch.plan)

    def _velocity(self, batch: LatentBatch, transformer: Any = None):
        sampler = self.recipe.rollout.sampler
        return bind(self.bundle, self.prompts(batch.prompts, sampler), sampler.guidance_scale, transformer)

    def _ref_velocity(self, batch: LatentBatch):
        if getattr(self.recipe.algorithm, "kl_coef", 0.0) <= 0:
            return None
        if self.reference is not None:
            return self._velocity(batch, self.reference)
        inner = self._velocity(batch)
        from stages.models.sd3 import reference_policy

        def ref(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            with reference_policy(self.bundle):
                return inner(x, sigma)

        return ref

    def _load_batches(self, iteration: int, rollouts: list[str], advantages: str):
        table = read_rollouts(self.storage, rollouts)
        adv_table = read_shard(self.storage, advantages, "advantages")
        if adv_table.num_rows < table.num_rows:  # dynamic sampling dropped groups
            import pyarrow.compute as pc

            table = table.filter(pc.is_in(table.column("sample_id"), value_set=adv_table.column("sample_id")))
        table = join_on_sample_id(table, adv_table, ["advantage"], self.storage.url(advantages))
        rows = list(range(table.num_rows))[self.rank::self.world]
        chunks, count = self._micro_batches(rows)
        s, algo = self.recipe.rollout.sampler, self.recipe.algorithm
        where = self.storage.url(rollouts[0]) + (" ..." if len(rollouts) > 1 else "")
        adv_all = table.column("advantage").to_numpy()
        batches = [read_latents(table, c, kind=s.sde_kind, eta=s.eta, where=where).to(self.device) for c in chunks]
        advs = [torch.tensor(adv_all[c], dtype=torch.float32, device=self.device) for c in chunks]
        if batches:
            requested = self.plan(iteration)
            check_sigmas(requested.sigmas, batches[0].plan.sigmas)
            want = requested.sde_indices.tolist() if algo.name in L.LIKELIHOOD_ALGORITHMS else None
            if want is not None and batches[0].plan.sde_indices.tolist() != want:
                raise SigmaMismatchError(
                    f"{where}: rollouts were sampled with SDE steps {batches[0].plan.sde_indices.tolist()}, the trainer "
                    f"expects {want} for iteration {iteration}; rollout.sampler must match between generate and train"
                )
        return batches, advs, count

    def train(self, iteration: int, rollouts: list[str], advantages: str) -> dict[str, Any]:
        """One batch: `updates_per_batch` optimizer steps, each over a contiguous run of this rank's
        micro-batches, against old log-probs frozen at sampling time."""
        start_time = time.perf_counter()
        algo, t = self.recipe.algorithm, self.recipe.train
        batches, advs, count = self._load_batches(iteration, rollouts, advantages)
        updates = t.updates_per_batch
        if updates > count:
            raise ValueError(f"train.updates_per_batch: {updates} updates need at least as many micro-batches per rank, "
                             f"this batch has {count}; lower it or train.micro_batch_size")
        bounds = [round(k * count / updates) for k in range(updates + 1)]
        template = self._shared_template(batches[0] if batches else None)

        def get(j: int) -> tuple[LatentBatch, torch.Tensor, float]:
            """Micro-batch j of this rank, its advantages and weight (0 for a stand-in)."""
            if j < len(batches):
                return batches[j], advs[j], 1.0
            return self._stand_in(template), torch.zeros(1, device=self.device), 0.0

        self.model.train()
        frozen: dict[int, torch.Tensor] = {}
        with torch.no_grad(), self.old_policy():
            for j in range(count):
                b, _, _ = get(j)
                if algo.name == "flow_dppo" and j >= bounds[1]:
                    frozen[j] = L.transition_means(self._velocity(b), b)
                elif algo.name == "nft":
                    update = next(k for k in range(updates) if bounds[k] <= j < bounds[k + 1])
                    frozen[j] = self._nft_old_velocities(b, iteration, update)
        totals: dict[str, float] = {}
        norms, skipped = [], 0
        for k in range(updates):
            sizes = torch.tensor([float(sum(len(batches[j].sample_ids) for j in range(bounds[k], min(bounds[k + 1], len(batches)))))],
                                 dtype=torch.float64, device=self.device)
            dist.all_reduce(sizes)
            for j in range(bounds[k], bounds[k + 1]):
                b, adv, real = get(j)
                share = real * len(b.sample_ids) / max(float(sizes[0]), 1.0) * self.world
                if algo.name == "nft":
                    metrics = L.nft_backward(algo, b, adv, self._velocity(b), frozen[j], weight=share,
                                             seed=self.recipe.seed, iteration=iteration, update=k)
                else:
                    metrics = L.likelihood_backward(
                        algo, b, adv, self._velocity(b), weight=share, ref_velocity=self._ref_velocity(b),
                        old_means=frozen.get(j), check_on_policy=(k == 0 and real > 0),
                        where=f"(iteration {iteration}, rank {self.rank})",
                    )
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value * len(b.sample_ids) * real
                totals["_samples"] = totals.get("_samples", 0.0) + len(b.sample_ids) * real
            norm = self._optimizer_step()
            if np.isfinite(norm):
                norms.append(norm)
            else:
                skipped += 1
        self.version += 1
        metrics = self._reduce(totals)
        metrics.update({"grad_norm": float(np.mean(norms)) if norms else float("nan"), "skipped_steps": skipped,
                        "lr": self.optimizer.param_groups[0]["lr"]})
        return {"iteration": iteration, "policy_version": self.version, "metrics": metrics,
                "seconds": time.perf_counter() - start_time}

    def _shared_template(self, template: LatentBatch | None) -> LatentBatch:
        """A rank without any micro-batch still needs the plan and shapes: take rank 0's."""
        info = [None if template is None else (template.latents.shape[1:], template.stored, template.plan)]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, info[0])
        shape, stored, plan = next(g for g in gathered if g is not None)
        if template is not None:
            return template
        k = plan.sde_indices.numel()
        return LatentBatch([], [], torch.zeros(0, *shape, device=self.device), torch.zeros(0, k, device=self.device), stored, plan)

    def _nft_old_velocities(self, batch: LatentBatch, iteration: int, update: int) -> list[torch.Tensor]:
        """v_old (under the weights in place: the old policy) at each NFT draw of `batch`."""
        velocity = self._velocity(batch)
        return [velocity(xt, tt) for tt, xt in L.nft_points(batch, seed=self.recipe.seed, iteration=iteration,
                                                             update=update, draws=self.recipe.algorithm.timesteps)]

    def ema_decay(self) -> float:
        """NFT's old policy follows its own decay schedule; other algorithms use the recipe's."""
        algo, decay = self.recipe.algorithm, self.recipe.train.ema.decay
        return algo.ema_decay(self.opt_steps, decay) if algo.name == "nft" else decay

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        keys = [k for k in METRIC_KEYS if k in totals] if self.rank == 0 else None
        holder = [keys]
        dist.broadcast_object_list(holder, src=0)
        keys = holder[0]
        vec = torch.tensor([totals.get(k, 0.0) for k in keys] + [totals.get("_samples", 0.0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        n = max(float(vec[-1]), 1.0)
        out = {k: float(vec[i]) / n for i, k in enumerate(keys)}
        out["samples"] = float(vec[-1])
        return out

    # -- supervised warm start --------------------------------------------------------------
    def sft(self, data: str, steps: int, batch_size: int, lr: float, seed: int, start_step: int = 0) -> dict[str, Any]:
        """Steps [start_step, start_step + steps) of flow matching on `data` (prompt, media_png).
        The first call warms up the VAE (`model.vae_warmup`), standardizes its latents and
        encodes every image once; the batch of step s is a function of (seed, s)."""
        from stages.diffusion import sft as S
        from stages.models.sd3 import encode_images

        start = time.perf_counter()
        info: dict[str, Any] = {}
        if not hasattr(self, "_sft_latents"):
            table = read_shard(self.storage, data, "sft")
            if "media_png" not in table.schema.names:
                raise ValueError(f"{self.storage.url(data)}: SFT records for an image model need a 'media_png' column")
            images = S.decode_images(table.column("media_png").to_pylist(), self.storage.url(data))
            from stages.models.sd3 import check_image_size

            check_image_size(self.bundle, images.shape[1], images.shape[2])
            warm = self.recipe.model.vae_warmup
            vae_steps = warm.resolved_steps(bool(self.recipe.model.path))
            if vae_steps:
                def reduce(grads: list[torch.Tensor]) -> None:
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    dist.all_reduce(flat)
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset:offset + g.numel()].reshape(g.shape) / self.world)
                        offset += g.numel()

                info.update(S.warm_up_vae(self.bundle.vae, images, steps=vae_steps, lr=warm.lr, batch_size=warm.batch_size,
                                          seed=seed, all_reduce=reduce, rank=self.rank, world=self.world))
                info.update(S.standardize_latents(self.bundle.vae, images))
            self._sft_latents = torch.cat([encode_images(self.bundle, images[i:i + 256]) for i in range(0, len(images), 256)])
            self._sft_prompts = table.column("prompt").to_pylist()
            self._sft_optimizer = torch.optim.AdamW(self.trainable, lr=lr, weight_decay=0.0)
            fm = self.recipe.model.flow_matching
            # This group only does SFT (flows/sft.py starts a fresh one for RL): its EMA is the SFT
            # EMA, which publish gathers and export writes as the transformer.
            self.ema = EMA(self.model, fm.ema) if fm.ema > 0 else None
        sampler = self.recipe.rollout.sampler
        fm = self.recipe.model.flow_matching
        total = self.recipe.sft.steps if self.recipe.sft is not None else start_step + steps
        losses = []
        self.model.train()
        for step in range(start_step, start_step + steps):
            factor = lr_factor(step, schedule=fm.schedule, warmup=fm.warmup_steps, total=total, min_ratio=0.0)
            for group in self._sft_optimizer.param_groups:
                group["lr"] = lr * factor
            idx = S.batch_indices(step, seed=seed, batch_size=batch_size, num_records=len(self._sft_prompts))
            mine = idx[self.rank::self.world] or idx[:1]
            real = 1.0 if idx[self.rank::self.world] else 0.0
            x0 = self._sft_latents[mine].to(self.device)
            g = torch.Generator().manual_seed(derive_seed(seed, "sft-noise", step, self.rank))
            noise = torch.randn(x0.shape, generator=g).to(self.device)
            sigma = S.logit_normal_sigmas(mine, seed=seed, step=step).to(self.device)
            velocity = bind(self.bundle, self.prompts([self._sft_prompts[i] for i in mine], sampler), 1.0)
            loss = S.flow_matching_loss(velocity, x0, noise, sigma)
            (loss * real * len(mine) / len(idx) * self.world).backward()
            torch.nn.utils.clip_grad_norm_(self.trainable, self.recipe.train.max_grad_norm)
            self._sft_optimizer.step()
            self._sft_optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:  # short memory at first, so early steps do not linger
                self.ema.decay = min(fm.ema, (1 + step) / (10 + step))
                self.ema.update(self.model)
            total = (loss.detach() * real * len(mine) / len(idx)).to(torch.float64).reshape(1)
            dist.all_reduce(total)
            losses.append(float(total))
        return {"loss": float(np.mean(losses)), "last_loss": losses[-1], "steps": start_step + steps,
                "seconds": time.perf_counter() - start, **info}

    # -- publication ------------------------------------------------------------------------
    def export(self, local: Path, full_state: dict[str, torch.Tensor]) -> None:
        """A diffusers SD3 folder: the base's encoders and scheduler, this worker's VAE and the
        transformer (LoRA merged), loadable as `model.path` of the next recipe."""
        state = full_state
        if hasattr(self, "_sft_latents") and getattr(self, "_ema_full", None) is not None:
            state = {**full_state, **self._ema_full}  # SFT publishes its EMA
        if self.lora is not None:
            state = merge_lora(full_state, rank=self.lora.rank, alpha=self.lora.alpha)
        write_sd3_folder(local, base_dir=self.base_dir, vae=self.bundle.vae, transformer_state=state)

"""The flow-matching latent policy, for any family that supplies a velocity, a text encoder and a
VAE (the flow-family operations of `unirl.stages.models.sd3.SD3` are the reference): prompts ->
embeddings (stages/diffusion/model.py), sampled trajectories with the SDE steps' log-probs
recorded at sampling time (stages/diffusion/sampling.py), the stored latent segment
(stages/diffusion/trajectory.py), and the trainer's replay of a stored transition, which calls the
sampler's own kernel on the same inputs: with the same weights and micro-batch the replayed
log-prob equals the recorded one bit for bit (the behaviour tolerance is 0).

Geometry: a rank's samples are the sorted sample ids [rank::world], cut by the train stack into
`train.updates_per_batch` mini-batches of micro-batches of `train.micro_batch_size`; generation
and training use the same cut. Latents are (C, h, w) for
images and (C, F, h, w) for video; nothing here assumes which.
"""
from __future__ import annotations

import dataclasses
import io
import math
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pydantic import Field, model_validator

from unirl.stages.diffusion.grid import GRID_COLUMNS, log_eval_grid, log_iteration_grid
from unirl.stages.models.flow_folder import latent_space_differences
from unirl.stages.policies import SAMPLES_COLUMNS, Policy, RolloutBase, iteration_rollouts, samples_table
from unirl.stages.runtime.accumulation import version_of
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.media import Media, decode_png, media_columns, media_counts, to_gif
from unirl.stages.runtime.registry import algorithms, kernels, policies
from unirl.stages.runtime.seeds import derive_seed

if TYPE_CHECKING:
    import torch

if TYPE_CHECKING:
    KernelName = str
else:
    KernelName = Literal[tuple(kernels.names())]  # the registered SDE kernels (stages/diffusion/kernels/)

class SDESteps(Section):
    """Which denoising steps are SDE steps (sampled with noise, stored and trained on); the others
    are ODE (Euler) steps. See `unirl.stages.diffusion.sde.select_sde_steps`."""

    mode: Literal["all", "window", "mixgrpo"] | None = Field(
        None,
        description="all: every step; window: `num_sde_steps` of a `window_size` block drawn per update (an "
        "iteration, or a window of train.accumulate_rollouts iterations; Flow-GRPO-Fast); mixgrpo: a `window_size` "
        "block sliding by `stride` every `shift_every` updates. "
        "Empty: the algorithm's (mixgrpo for MixGRPO, else all).",
    )
    window: tuple[float, float] = Field((0.0, 1.0), description="[lo, hi) fractions of the schedule the steps come from.")
    window_size: int | None = Field(None, ge=1, description="Steps in the block; empty: the whole `window`.")
    num_sde_steps: int | None = Field(None, ge=1, description="mode window: steps drawn from the block; empty: all of it.")
    stride: int = Field(1, ge=1, description="mode mixgrpo: steps the block moves at a time.")
    shift_every: int = Field(1, ge=1, description="mode mixgrpo: updates between moves.")
    wrap: bool = Field(False, description="mode mixgrpo: restart from the first step after the last position.")

    @property
    def selection(self) -> str:
        """The mode in force: `mode`, or every step when it is left empty."""
        return self.mode or "all"


def fraction_range(num_steps: int, window: tuple[float, float]) -> tuple[int, int]:
    """Steps i with lo <= i/T < hi as [first, end)."""
    lo, hi = window
    return math.ceil(lo * num_steps - 1e-9), math.ceil(hi * num_steps - 1e-9)


class FlowSampler(Section):
    """How latents are sampled."""

    num_steps: int = Field(10, ge=1, description="Denoising steps T.")
    shift: float = Field(3.0, gt=0, description="Sigma shift (docs/architecture.md, `shifted_sigmas`).")
    dynamic_shift: bool = Field(False, description="Shift from the number of latent tokens (FLUX / SD3.5) instead of `shift`.")
    guidance_scale: float = Field(1.0, ge=1, description="Classifier-free guidance; 1 is guidance-free.")
    negative_prompt: str = Field("", description="Negative prompt for CFG.")
    eta: float = Field(0.7, ge=0, description="SDE noise level.")
    sde_kind: KernelName | None = Field(
        None, description="SDE step kernel; empty: the algorithm's (dance for DanceGRPO, cps for CPS, else flow).")
    init_same_noise: bool = Field(True, description="One initial noise per group (else per sample).")
    image_size: int | None = Field(None, ge=8, description="Side of sampled images (or video frames); empty: the model's default.")
    num_frames: int | None = Field(
        None, ge=1, description="Frames of sampled videos (video families only); empty: the model's default.")
    sde_steps: SDESteps = Field(default_factory=SDESteps, description="Which steps are SDE steps.")

    @property
    def kernel(self) -> str:
        """The SDE kernel in force: `sde_kind`, or Flow-GRPO's when it is left empty."""
        return self.sde_kind or "flow"

    @model_validator(mode="after")
    def _check_window(self) -> FlowSampler:
        sel, t = self.sde_steps, self.num_steps
        lo, hi = sel.window
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"rollout.sampler.sde_steps.window: need 0 <= lo < hi <= 1, got [{lo}, {hi}]")
        if sel.selection == "all":
            return self
        first, end = fraction_range(t, sel.window)
        span = end - first
        if span < 1:
            raise ValueError(
                f"rollout.sampler.sde_steps.window: [{lo}, {hi}] holds no step of num_steps={t}; widen it or raise num_steps"
            )
        size = span if sel.window_size is None else sel.window_size
        if size > span:
            raise ValueError(
                f"rollout.sampler.sde_steps.window_size: {size} is larger than the {span} steps available "
                f"(steps {first}..{end - 1} of num_steps={t} in window [{lo}, {hi}]); lower window_size, "
                "widen window or raise rollout.sampler.num_steps"
            )
        if sel.mode == "window" and sel.num_sde_steps is not None and sel.num_sde_steps > size:
            raise ValueError(
                f"rollout.sampler.sde_steps.num_sde_steps: {sel.num_sde_steps} is more than the window's {size} steps"
            )
        return self


class FlowRollout(RolloutBase):
    """How flow-matching samples are generated."""

    kind: Literal["flow"] = Field("flow", description="Policy kind (set from the model family).")
    sampler: FlowSampler = Field(default_factory=FlowSampler, description="Latent sampling.")


TABLE_CELL = 128  # pixels a table's picture is enlarged to, at least


def media_cell(table: Any, i: int) -> dict[str, Any]:
    """A flow rollout's picture for its table row: the PNG image, or the clip as an animated GIF."""
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    def seen(png: bytes) -> Any:  # a tiny model's 16-pixel sample, enlarged to be seen (nearest: no blur)
        image = decode_png(png)
        scale = max(1, TABLE_CELL // max(image.size))
        return image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)

    frames = table.column("media_frames")[i].as_py() if "media_frames" in table.column_names else None
    if frames:
        return {"video": Media(to_gif([seen(f) for f in frames]), "gif")}
    buf = io.BytesIO()
    seen(table.column("media_png")[i].as_py()).save(buf, format="PNG")
    return {"image": Media(buf.getvalue(), "png")}


@policies.register("flow")
class FlowPolicy(Policy):
    kind = "flow"
    segment = "latent"
    weight_name = "samples"
    rollout_config = FlowRollout
    # sigmas [T+1], chosen SDE step indices [S], latents at the stored steps (flattened;
    # `latent_shape` gives the per-step shape), per-step log-probs [S], the seed of the initial noise,
    # and the encoded media for rewards and previews: an image's PNG, or a video's frames, one PNG
    # each (stages/runtime/media.py says why), the other column empty.
    columns = {
        "sigmas": pa.list_(pa.float32()),
        "sde_indices": pa.list_(pa.int32()),
        "latents": pa.list_(pa.float32()),
        "latent_shape": pa.list_(pa.int32()),
        "sde_logprobs": pa.list_(pa.float32()),
        "noise_seed": pa.int64(),
        "media_png": pa.binary(),
        "media_frames": pa.list_(pa.binary()),
    }
    wire = "unirl.stages.engines.flow_wire:FlowWire"
    server_backend = "unirl.stages.engine_server.flow:FlowBackend"
    sft_first = True

    @classmethod
    def default_tolerance(cls, dtype: str) -> float:
        return 0.0

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Resolve the sampler settings the algorithm implies (DanceGRPO's kernel, MixGRPO's
        window) where the recipe leaves them empty, refuse ones that contradict it, and refuse
        settings no flow sample can use."""
        sampler = recipe.rollout.sampler
        algo = algorithms.get(recipe.algorithm.name)
        wanted = {"sde_kind": sampler.kernel, "sde_steps.mode": sampler.sde_steps.selection, **algo.sampler_defaults()}
        for path, value in wanted.items():
            node, leaf = (sampler.sde_steps, "mode") if path == "sde_steps.mode" else (sampler, path)
            current = getattr(node, leaf)
            if current is None:
                setattr(node, leaf, value)
            elif path in algo.sampler_defaults() and current != value:
                raise ValueError(f"rollout.sampler.{path}: algorithm {algo.name!r} samples with {path}={value!r}, the "
                                 f"recipe sets {current!r}; remove it or choose another algorithm.name")
        sampler._check_window()  # the window rules again, now that the mode is known
        if recipe.rollout.dynamic_sampling is not None and algo.replays_transitions and not recipe.rollout.behaviour_tolerance:
            raise ValueError(
                "rollout.dynamic_sampling: the trainer replays the kept groups in other micro-batches than sampled them "
                "(the dropped groups leave gaps), and a flow replay equals the sampler's record only in the same "
                "micro-batch (the flow behaviour tolerance is 0). Set "
                "rollout.behaviour_tolerance (e.g. 1e-5) to accept that rounding, or remove dynamic_sampling"
            )
        if recipe.reward.overlong.truncated != "keep":
            raise ValueError("reward.overlong.truncated: flow samples are never truncated; remove reward.overlong")
        t = recipe.train
        for knob, value in (("max_tokens_per_micro_batch", t.max_tokens_per_micro_batch), ("packing", t.packing),
                            ("logprob_chunk_tokens", t.logprob_chunk_tokens)):
            if value:
                raise ValueError(f"train.{knob}: a language model's knob; every sample of a flow model has the same "
                                 "latent size and no vocabulary: cut its micro-batches with train.micro_batch_size")
        if sampler.init_same_noise and (sampler.eta == 0 or kernels.get(sampler.kernel).deterministic) and recipe.rollout.group_size > 1:
            raise ValueError(
                "rollout.sampler.init_same_noise: with deterministic sampling (eta 0 or sde_kind ode) one initial "
                "noise per group makes every image of a group the same, so no group carries a signal; set "
                "`init_same_noise: false`"
            )

    @classmethod
    def log_preview(cls, recipe: Any, tracker: Any, storage: Any, iteration: int) -> str | None:
        """An image grid (an animated GIF grid for video) of the iteration's rollouts, with rewards,
        and the table of its first samples with each image (clip) in its row: prompt, image,
        reward, advantage, version (MLflow `tables/samples/step-N.json`)."""
        table = iteration_rollouts(storage, iteration, list(dict.fromkeys([*GRID_COLUMNS, *SAMPLES_COLUMNS])))
        if table is None:
            return None
        grid = log_iteration_grid(tracker, storage, iteration, table)  # the media read once for both
        columns = samples_table(storage, iteration, [], media_cell, table=table)
        if columns is not None:
            tracker.log_table(iteration, columns, "samples")
        return grid

    @classmethod
    def log_eval_preview(cls, recipe: Any, tracker: Any, storage: Any, version: int) -> str | None:
        """The grid of the held-out samples (greedy, ODE) of policy `version`."""
        return log_eval_grid(tracker, storage, version)

    def __init__(self, family: Any, bundle: Any, recipe: Any, device: torch.device):
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.model import PromptCache

        # Policy-gradient steps make many tiny gradients; Adam's squared averages of those turn
        # denormal, and CPU kernels that touch denormals run many times slower.
        torch.set_flush_denormal(True)
        self.family, self.bundle, self.recipe, self.device = family, bundle, recipe, device
        self.sampler: FlowSampler = recipe.rollout.sampler
        self.image_size = self.sampler.image_size or family.default_image_size(bundle)
        self.num_frames = self.sampler.num_frames or family.default_num_frames(bundle)
        family.check_image_size(bundle, self.image_size)  # before any compute
        self.shape = tuple(family.latent_shape(bundle, self.image_size, self.num_frames))
        self.prompts = PromptCache(family, bundle)

    # -- conditions -----------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> Any:
        return self.prompts(prompts, self.sampler)

    def velocity(self, module: Any, prompts: list[str]) -> Any:
        """v(x, sigma) of `module` (the policy, the EMA old policy or the reference) for `prompts`."""
        from unirl.stages.diffusion.model import bind  # start-up time: it loads torch

        return bind(self.family, self.bundle, self.encode(prompts), self.sampler.guidance_scale, module)

    def check_teacher(self, name: str, directory: Any) -> None:
        """A flow teacher runs in the student's latent space on the student's text conditioning
        (only its transformer is loaded), so its folder's VAE, text encoders and tokenizers must
        be the student's: ValueError naming the files that differ."""
        differ = latent_space_differences(self.bundle.directory, directory)
        if differ:
            raise ValueError(
                f"distillation teacher {name!r} ({directory}): its {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''} "
                f"differ from the student's ({self.bundle.directory}); a flow teacher's velocity is only meaningful in "
                "the student's latent space, with the student's text encoders. Give a teacher trained from the "
                "student's initial weights (`sft` with `init: student`, or a folder made so)")

    def plan(self, iteration: int, *, deterministic: bool = False) -> Any:
        """The sampling plan of `iteration`: its SDE steps are drawn per update (`version_of`), so
        the batches of a rollout-accumulation window, trained as one, share them."""
        from unirl.stages.diffusion.sampling import make_plan  # start-up time: it loads torch

        return make_plan(self.sampler, seed=self.recipe.seed, iteration=version_of(self.recipe, iteration),
                         latent_tokens=self.family.latent_tokens(self.bundle, self.shape), deterministic=deterministic,
                         mu=lambda tokens, steps: self.family.dynamic_mu(self.bundle, tokens, steps))

    # -- sampling -------------------------------------------------------------------------------
    def rollout(self, module: Any, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, stack: Any, transitions: bool) -> list[dict[str, Any]]:
        """Sample this rank's (sample id, group id, prompt, metadata) micro-batch by micro-batch.
        `transitions`: keep x_i and x_{i+1} of every SDE step (likelihood losses), else only x_T.
        greedy: the deterministic ODE sampler (evaluation)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.sampling import sample, stored_steps
        from unirl.stages.diffusion.sde import initial_noise
        from unirl.stages.diffusion.trajectory import latent_rows  # start-up time: it loads torch

        plan = self.plan(iteration, deterministic=greedy)
        store = stored_steps(plan.sde_indices.tolist(), plan.num_steps, transitions=transitions and not greedy)
        t = self.recipe.train
        groups, counts = stack.cut(samples, t.micro_batch_size, t.updates_per_batch)
        slots = [group[c] if c < len(group) else None for group, count in zip(groups, counts) for c in range(count)]
        module.eval()
        rows = []
        for chunk in slots:
            if chunk is None:  # take part in the collectives only
                sample(self.velocity(module, [""]), torch.zeros(1, *self.shape, device=self.device), plan, [0], store=[plan.num_steps])
                continue
            noises, noise_seeds = zip(*(
                initial_noise(self.shape, base_seed=derive_seed(self.recipe.seed, seed_tag), group_id=gid, sample_id=sid,
                              init_same_noise=self.sampler.init_same_noise)
                for sid, gid, _, _ in chunk
            ))
            sde_seeds = [derive_seed(self.recipe.seed, seed_tag, "sde", iteration, sid) for sid, _, _, _ in chunk]
            traj = sample(self.velocity(module, [p for _, _, p, _ in chunk]), torch.stack(noises).to(self.device), plan,
                          sde_seeds, store=store)
            media = media_columns(self.family.decode(self.bundle, traj.final))
            for (sid, gid, prompt, meta), seg, seed, m in zip(chunk, latent_rows(traj.latents, traj.logprobs, plan), noise_seeds, media):
                rows.append({"sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "noise_seed": seed,
                             **m, **seg})
        return rows

    @staticmethod
    def counters(rows: list[dict[str, Any]]) -> dict[str, int]:
        return media_counts(rows)

    # -- replay ---------------------------------------------------------------------------------
    def batches(self, table: pa.Table, chunks: list[list[int]], advantages: Any, where: str) -> list[Any]:
        """Micro-batches (LatentBatch with advantages) of a rollout table, one per chunk of rows."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.trajectory import read_latents

        kind, eta = self.sampler.kernel, self.sampler.eta
        out = []
        for rows in chunks:
            b = read_latents(table, rows, kind=kind, eta=eta, where=where).to(self.device)
            out.append(dataclasses.replace(b, advantage=torch.tensor(advantages[rows], dtype=torch.float32, device=self.device)))
        return out

    def check_batch(self, batch: Any, iteration: int, algorithm: Any, where: str) -> None:
        """The stored rows were sampled with this iteration's sigmas (and SDE steps, when the loss
        replays them): the trainer must replay what the sampler did."""
        from unirl.stages.diffusion.sde import SigmaMismatchError, check_sigmas  # start-up time: it loads torch

        requested = self.plan(iteration)
        check_sigmas(requested.sigmas, batch.plan.sigmas)
        if algorithm.replays_transitions and batch.plan.sde_indices.tolist() != requested.sde_indices.tolist():
            raise SigmaMismatchError(
                f"{where}: rollouts were sampled with SDE steps {batch.plan.sde_indices.tolist()}, the trainer "
                f"expects {requested.sde_indices.tolist()} for iteration {iteration}; rollout.sampler must match between "
                "generate and train"
            )

    def template(self, batch: Any, stack: Any) -> Any:
        """A rank without any micro-batch still needs the plan and shapes: take the first rank's."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.sampling import Plan
        from unirl.stages.diffusion.trajectory import LatentBatch

        info = None if batch is None else {
            "shape": list(batch.latents.shape[1:]), "stored": batch.stored, "sigmas": batch.plan.sigmas.tolist(),
            "sde_indices": batch.plan.sde_indices.tolist(), "kind": batch.plan.kind, "eta": batch.plan.eta}
        first = next(g for g in stack.all_gather_json(info) if g is not None)
        if batch is not None:
            return batch
        shape, stored = tuple(first["shape"]), first["stored"]
        plan = Plan(torch.tensor(first["sigmas"], dtype=torch.float32), torch.tensor(first["sde_indices"], dtype=torch.int64),
                    first["kind"], first["eta"])
        k = plan.sde_indices.numel()
        return LatentBatch([], [], torch.zeros(0, *shape, device=self.device), torch.zeros(0, k, device=self.device), stored, plan)

    def stand_in(self, template: Any) -> Any:
        """A one-sample batch of zeros shaped like `template` (weight 0: collectives only)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion.trajectory import LatentBatch

        return LatentBatch(["stand-in"], [""], torch.zeros_like(template.latents[:1]), torch.zeros_like(template.logprobs[:1]),
                           template.stored, template.plan, torch.zeros(1, device=self.device))

    def replay(self, module: Any, batch: Any, selection: int, v: torch.Tensor | None = None) -> Any:
        """The stored transition at SDE step `selection` scored under `module`: SDEStepOutput
        (log_prob (B,), mean, std); the same kernel call the sampler made. `v`: the velocity
        at the stored state when the caller has it (`state_velocity`), instead of a forward."""
        from unirl.stages.diffusion.sampling import replay_step  # start-up time: it loads torch

        if v is None:
            v = self.state_velocity(module, batch, selection)
        return replay_step(batch.plan, selection, batch.at(selection), v, batch.at(selection + 1))

    def state_velocity(self, module: Any, batch: Any, selection: int) -> torch.Tensor:
        """(B, *latent) velocity of `module` at the stored state x of step `selection` (sigma of
        that step), on the rows' prompts: the forward `replay` scores the transition with."""
        x = batch.at(selection)
        return self.velocity(module, batch.prompts)(x, batch.plan.sigmas[selection].expand(x.shape[0]))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.family.decode(self.bundle, latents)

    # -- supervised warm start ------------------------------------------------------------------
    @classmethod
    def sft_spec(cls, recipe: Any) -> tuple[Any, Any]:
        """AdamW at `sft.lr` on the family's `flow_matching` schedule over `sft.steps`, and its EMA
        (what SFT publishes), whose decay starts short so early steps do not linger."""
        from unirl.stages.train.stack import OptimizerSpec  # start-up time: it loads torch

        fm = recipe.model.flow_matching
        spec = OptimizerSpec(lr=recipe.sft.lr, schedule=fm.schedule, warmup=fm.warmup_steps, total=recipe.sft.steps,
                             max_grad_norm=recipe.train.max_grad_norm, ema=fm.ema if fm.ema > 0 else None)
        return spec, lambda step: min(fm.ema, (1 + step) / (10 + step))

    def sft_setup(self, table: pa.Table, where: str, stack: Any, seed: int) -> dict[str, Any]:
        """Decode the records' images (or clips), let the family prepare its VAE for them (a tiny
        model's is random), and encode every record to latents once."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion import sft as S

        if self.num_frames is not None:
            if "media_frames" not in table.schema.names:
                raise ValueError(f"{where}: SFT records for a video model need a 'media_frames' column (PNG frames per clip)")
            images = S.decode_videos(table.column("media_frames").to_pylist(), where)
            if images.shape[1] != self.num_frames:
                raise ValueError(f"{where}: SFT clips have {images.shape[1]} frames, the sampler makes {self.num_frames}; "
                                 "set rollout.sampler.num_frames to match the records")
        elif "media_png" not in table.schema.names:
            raise ValueError(f"{where}: SFT records for an image model need a 'media_png' column")
        else:
            images = S.decode_images(table.column("media_png").to_pylist(), where)
        self.family.check_image_size(self.bundle, images.shape[-3], images.shape[-2])

        def reduce(grads: list[torch.Tensor]) -> None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            stack.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].reshape(g.shape) / stack.world)
                offset += g.numel()

        info = self.family.prepare_sft(self.bundle, self.recipe.model, images, seed=seed, all_reduce=reduce,
                                       rank=stack.rank, world=stack.world)
        self._sft_latents = torch.cat([self.family.encode_images(self.bundle, images[i:i + 256]) for i in range(0, len(images), 256)])
        self._sft_prompts = table.column("prompt").to_pylist()
        return info

    def sft_loss(self, module: Any, step: int, *, seed: int, batch_size: int, stack: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow matching on step `step`'s records (a function of (seed, step)), as this rank's share
        of the batch mean: (loss to backpropagate, its value to sum over ranks)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.diffusion import sft as S

        idx = S.batch_indices(step, seed=seed, batch_size=batch_size, num_records=len(self._sft_prompts))
        mine = stack.my_share(idx) or idx[:1]
        real = 1.0 if stack.my_share(idx) else 0.0
        x0 = self._sft_latents[mine].to(self.device)
        g = torch.Generator().manual_seed(derive_seed(seed, "sft-noise", step, stack.rank))
        noise = torch.randn(x0.shape, generator=g).to(self.device)
        sigma = S.logit_normal_sigmas(mine, seed=seed, step=step, shift=self.recipe.model.flow_matching.sigma_shift).to(self.device)
        from unirl.stages.diffusion.model import bind  # start-up time: it loads torch

        velocity = bind(self.family, self.bundle, self.prompts([self._sft_prompts[i] for i in mine], self.sampler), 1.0, module)
        loss = S.flow_matching_loss(velocity, x0, noise, sigma)
        return loss * real * len(mine) / len(idx) * stack.world, loss.detach() * real * len(mine) / len(idx)

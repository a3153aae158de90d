"""The train stack: the one owner of what every trainable model needs, whatever its family,
policy or algorithm, in a worker group or in one process.

* FSDP2 `fully_shard` on the family's units (a one-rank group keeps the plain module), and
  activation checkpointing on the same units (`train.activation_checkpointing`);
* the frozen reference policy (the adapter disabled with LoRA, else a sharded frozen copy);
* AdamW, the learning-rate schedule, gradient clipping, skipping a step whose gradient norm is
  not finite, and an EMA of the trainable weights with the swap that puts it in place;
* micro-batch geometry across ranks (every rank issues the same collectives in the same order);
* metric reduction across ranks; checkpoint and publish (stages/train/checkpoint.py).

Collectives are no-ops without a process group, so the in-process loop (stages/run/loop.py) runs
this same code in one process.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.train.collectives import all_gather_json, broadcast_json
from unirl.stages.train.shards import fill, is_empty, lora_init


def lr_factor(step: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr before optimizer step `step` (0-based).
    constant: 1 after warm-up; linear: warm-up then linear decay to min_ratio at `total`;
    cosine: warm-up then min_ratio + (1-min_ratio) * (1 + cos(pi * progress)) / 2."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r} (allowed: constant, linear, cosine)")


class EMA:
    """theta_ema <- decay * theta_ema + (1 - decay) * theta, over the trainable parameters (local
    shards under FSDP2, so the EMA is sharded like the model)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and its schedule: lr * lr_factor(step) before every step; `total` steps in all."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup: int = 0
    total: int = 1
    min_ratio: float = 0.0
    max_grad_norm: float = 1.0
    ema: float | None = None  # decay of an EMA of the trainable weights; None: no EMA


def checkpoint_blocks(units: list[torch.nn.Module]) -> int:
    """Activation checkpointing on each unit (a family's blocks: decoder layers, transformer blocks;
    `fsdp_units`): its activations are not kept for the backward but recomputed there from its
    input, non-reentrant (torch.utils.checkpoint's autograd-friendly form, through the composable
    API: parameter names and state dicts are unchanged, and FSDP2 goes on top). A block frozen whole
    keeps nothing anyway and is left as it is. Returns how many blocks checkpoint. Applied before
    sharding (TrainStack)."""
    from torch.distributed._composable import checkpoint  # start-up time: loaded on first use

    trained = [u for u in units if any(p.requires_grad for p in u.parameters())]
    for unit in trained:
        checkpoint(unit)
    return len(trained)


def shard(model: torch.nn.Module, units: list[torch.nn.Module], mesh: Any, mixed_precision: str = "off") -> torch.nn.Module:
    """FSDP2 `fully_shard` on each unit (decoder layer, transformer block) and at the root. A
    one-rank group keeps the plain module: sharding there is a copy and two hooks per unit and
    forward with nothing to shard, slower for nothing; checkpoints and publication read both the
    same way.
    `mixed_precision` "bf16": FSDP2's MixedPrecisionPolicy (bf16 parameters in forward and
    backward, fp32 gradient reduction, the stored weights and optimizer in their own dtype), on
    any world size."""
    if world_size() == 1 and mixed_precision == "off":
        return model
    if mesh is None:
        raise ValueError("train.mixed_precision needs a worker group (it is FSDP2's); the in-process loop has none")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # start-up time: torch loads on first use, not when a recipe is read

    options: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def load_bundle(family: Any, directory: Any, cfg: Any, device: Any, *, sharded: bool) -> Any:
    """The family's bundle of the model in `directory`: its trainable module built on the meta
    device (each rank's shards filled by TrainStack, stages/train/shards.py) when `sharded` and
    the family can, else loaded whole."""
    bundle = family.load_empty(directory, cfg, device) if sharded else None
    return bundle if bundle is not None else family.load(directory, cfg, device)


def micro_batches(items: Sequence[Any], size: int, updates: int = 1) -> list[list[list[Any]]]:
    """`items` split into `updates` balanced mini-batches, each cut into micro-batches of at most
    `size`: the cut sampling and training share (TrainStack.cut), which an engine batching for an
    exact replay also follows."""
    n = len(items)
    bounds = [round(k * n / updates) for k in range(updates + 1)]
    return [[list(items[i:min(i + size, bounds[k + 1])]) for i in range(bounds[k], bounds[k + 1], size)]
            for k in range(updates)]


def token_micro_batches(items: Sequence[Any], lengths: Sequence[int], budget: int, updates: int = 1,
                        packed: bool = False) -> list[list[list[Any]]]:
    """`items` split into the same `updates` mini-batches as `micro_batches`, each cut into
    micro-batches by a token budget instead of a count: its rows in order of length (longest
    first, ties in their order), a micro-batch taking rows while its tokens stay within `budget`
    (padded: rows x its longest row; `packed`: the rows' lengths summed). A row longer than the
    budget is a micro-batch alone. Every row is in exactly one micro-batch."""
    n = len(items)
    bounds = [round(k * n / updates) for k in range(updates + 1)]
    out = []
    for k in range(updates):
        rows = sorted(range(bounds[k], bounds[k + 1]), key=lambda i: (-lengths[i], i))
        groups: list[list[Any]] = []
        current: list[int] = []
        longest = used = 0
        for i in rows:
            cost = used + lengths[i] if packed else (len(current) + 1) * max(longest, lengths[i])
            if current and cost > budget:
                groups.append([items[j] for j in current])
                current, longest, used = [], 0, 0
            current.append(i)
            longest, used = max(longest, lengths[i]), used + lengths[i]
        if current:
            groups.append([items[j] for j in current])
        out.append(groups)
    return out


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_of() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TrainStack:
    """`bundle.module` (a family's trainable module) sharded and trained. `ema_decay(step)` gives
    the EMA decay after optimizer step `step` (the spec's by default; NFT's old policy and SFT
    follow their own schedules)."""

    def __init__(self, family: Any, bundle: Any, *, mesh: Any, device: torch.device, spec: OptimizerSpec,
                 reference_dir: Any = None, reference_cfg: Any = None, lora: Any = None, seed: int = 0,
                 ema_decay: Callable[[int], float] | None = None, weights_dir: Any = None,
                 sharded_load: bool = False, mixed_precision: str = "off", activation_checkpointing: bool = False):
        self.family, self.bundle, self.mesh, self.device, self.spec = family, bundle, mesh, device, spec
        self.rank, self.world = rank_of(), world_size()
        self.lora = lora
        if lora is not None:  # seeded: a restarted group must draw the same initial adapters
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, "lora-init"))
                family.add_lora(bundle, lora)
            if not is_empty(bundle.module):
                lora_init(bundle.module, seed)  # the values a sharded load draws too
        if activation_checkpointing:  # the trained module only: frozen ones run without autograd
            checkpoint_blocks(family.fsdp_units(bundle.module))
        bundle.module = self.module = self._build(bundle.module, weights_dir, seed, mixed_precision)
        self._reference = None
        self.teachers: dict[str, torch.nn.Module] = {}  # on-policy distillation's, by name (set by the worker)
        self._seed, self._sharded_load, self._mixed_precision = seed, sharded_load, mixed_precision
        if reference_dir is not None and lora is None:  # a full fine-tune keeps a frozen copy
            self._reference = self.frozen(reference_dir, reference_cfg)
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
        self.ema = EMA(self.module, spec.ema) if spec.ema else None
        self._ema_decay = ema_decay
        self.opt_steps = 0
        self.ema_full: dict[str, torch.Tensor] | None = None  # gathered by publish

    def frozen(self, directory: Any, cfg: Any) -> torch.nn.Module:
        """The family's model in `directory`, frozen and sharded as the trained module is (the
        reference policy; a distillation teacher, of any size the family loads)."""
        module = load_bundle(self.family, directory, cfg, self.device, sharded=self._sharded_load).module
        return self._build(module.requires_grad_(False).eval(), directory, self._seed, self._mixed_precision)

    def teacher(self, name: str) -> torch.nn.Module:
        """The frozen teacher `name` (on-policy distillation, docs/distillation.md)."""
        if name not in self.teachers:
            raise ValueError(f"this train stack holds the teachers {sorted(self.teachers)}, not {name!r}")
        return self.teachers[name]

    def _build(self, module: torch.nn.Module, weights_dir: Any, seed: int, mixed_precision: str) -> torch.nn.Module:
        """`module` sharded on this stack's device; one built on the meta device gets only this
        rank's shards, read from the family's weight files in `weights_dir`."""
        if not is_empty(module):
            return shard(module.to(self.device), self.family.fsdp_units(module), self.mesh, mixed_precision)
        if weights_dir is None:
            raise ValueError("a module built on the meta device needs the folder its weights are read from")
        module = shard(module, self.family.fsdp_units(module), self.mesh, mixed_precision)
        fill(module, self.device, self.family.weight_files(weights_dir), seed=seed)
        return module

    # -- collectives (no-ops in one process) ----------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return tensor

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj` (JSON bytes between ranks: nothing is unpickled)."""
        return [obj] if self.world == 1 else all_gather_json(obj, device=self.device)

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's JSON-able `obj` on every rank."""
        return obj if self.world == 1 else broadcast_json(obj, rank=self.rank, device=self.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # -- geometry -------------------------------------------------------------------------------
    def my_share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's items of a globally sorted list: [rank::world]."""
        return list(items[self.rank::self.world])

    def cut(self, items: Sequence[Any], size: int, updates: int = 1) -> tuple[list[list[list[Any]]], list[int]]:
        """`items` (this rank's, in order) split into `updates` balanced mini-batches, each cut into
        micro-batches of at most `size`; and per mini-batch the most micro-batches any rank has:
        every rank runs that many, ranks short of it with stand-ins of weight 0. Sampling and
        training cut the same way, so the first update replays exactly the sampled micro-batches."""
        return self.counted(micro_batches(items, size, updates))

    def cut_by_tokens(self, items: Sequence[Any], lengths: Sequence[int], budget: int, updates: int = 1,
                      packed: bool = False) -> tuple[list[list[list[Any]]], list[int]]:
        """`cut` by a token budget (`token_micro_batches`; `lengths[i]`: item i's tokens): the same
        mini-batches, so the same optimizer steps over the same rows, in other micro-batches."""
        return self.counted(token_micro_batches(items, lengths, budget, updates, packed))

    def counted(self, groups: list[list[list[Any]]]) -> tuple[list[list[list[Any]]], list[int]]:
        """`groups` and, per mini-batch, the most micro-batches any rank has (the others run stand-ins)."""
        counts = torch.tensor([len(g) for g in groups], dtype=torch.int64, device=self.device)
        self.all_reduce(counts, "max")
        return groups, [int(c) for c in counts]

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> float:
        """Clip, then step at the scheduled lr unless the gradient norm is not finite (the step is
        skipped and not counted), then update the EMA. Returns the norm."""
        s = self.spec
        total = torch.nn.utils.clip_grad_norm_(self.trainable, s.max_grad_norm)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        if np.isfinite(norm):
            factor = lr_factor(self.opt_steps, schedule=s.schedule, warmup=s.warmup, total=s.total, min_ratio=s.min_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = s.lr * factor
            self.optimizer.step()
            if self.ema is not None:
                if self._ema_decay is not None:
                    self.ema.decay = self._ema_decay(self.opt_steps)
                self.ema.update(self.module)
            self.opt_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # -- policies other than the one training -------------------------------------------------
    @contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Inside the block the module holds the EMA weights (the old policy of NFT)."""
        if self.ema is None:
            raise ValueError("the EMA weights need train.ema")
        self._reshard()
        backup = {n: p.detach().clone() for n, p in self.module.named_parameters() if n in self.ema.shadow}
        with torch.no_grad():
            for n, p in self.module.named_parameters():
                if n in backup:
                    p.copy_(self.ema.shadow[n])
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for n, p in self.module.named_parameters():
                    if n in backup:
                        p.copy_(backup[n])

    def maybe_ema(self, use: bool) -> Any:
        return self.ema_weights() if use else nullcontext()

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters gathered after a forward; swap weights only on shards."""
        if self.world == 1:
            return
        from torch.distributed.fsdp import FSDPModule  # start-up time: torch loads on first use, not when a recipe is read

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @contextmanager
    def reference(self) -> Iterator[Any]:
        """The frozen reference policy: the adapter disabled with LoRA (no second copy), else the copy."""
        if self.lora is not None:
            with self.family.reference(self.bundle):
                yield self.module
        elif self._reference is not None:
            yield self._reference
        else:
            raise ValueError("this train stack keeps no reference policy (the algorithm asks for none)")

    # -- metrics --------------------------------------------------------------------------------
    def reduce_metrics(self, totals: dict[str, float], weight: float, maxima: dict[str, float], weight_name: str) -> dict[str, float]:
        """Weighted means across ranks of `totals` (sums of value * weight; the keys of rank 0),
        maxima across ranks of `maxima`, and the total weight as `weight_name`."""
        keys = self.broadcast_json(sorted(totals) if self.rank == 0 else None)
        vec = torch.tensor([totals.get(k, 0.0) for k in keys] + [weight], dtype=torch.float64, device=self.device)
        self.all_reduce(vec)
        n = max(float(vec[-1]), 1.0)
        out = {k: float(vec[i]) / n for i, k in enumerate(keys)}
        out[weight_name] = float(vec[-1])
        max_keys = self.broadcast_json(sorted(maxima) if self.rank == 0 else None)
        if max_keys:
            top = torch.tensor([maxima.get(k, -math.inf) for k in max_keys], dtype=torch.float64, device=self.device)
            self.all_reduce(top, "max")
            out.update({k: float(top[i]) for i, k in enumerate(max_keys)})
        return out

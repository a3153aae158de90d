"""What every rank of a worker group holds and does, for every model family: the family's bundle,
its policy, the recipe's algorithm and the train stack around the trainable module, and the
commands ping / generate / train / sft / save / publish.

Data moves only through run storage: commands carry relative paths, never tensors. The same
class runs in one process without a process group (stages/run/loop.py).
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow.compute as pc
import torch

from unirl.stages.algorithms.base import get_algorithm
from unirl.stages.compose import shape_of
from unirl.stages.compose.shared import JointSFT, split_by_stage, with_stage
from unirl.stages.distill import teacher_folders, teacher_of
from unirl.stages.engines.update_group import broadcast, dtype_name, init_group
from unirl.stages.models.family import get_family
from unirl.stages.policies import behaviour_mask_limit, behaviour_tolerance
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.accumulation import schedule_steps
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.images import IMAGE_COLUMNS
from unirl.stages.runtime.registry import policies
from unirl.stages.runtime.sample import join_on_sample_id, metadata, read_rollouts, read_shard, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, join
from unirl.stages.runtime.weights_checksum import tensors_checksum
from unirl.stages.train import checkpoint
from unirl.stages.train.adapter import publish_adapter
from unirl.stages.train.manifests import MANIFEST
from unirl.stages.train.stack import OptimizerSpec, TrainStack, load_bundle, rank_of, world_size
from unirl.stages.train.staging import NoRoom, stage_adapter, stage_tensors
from unirl.stages.train.update import UpdatePart, joint_update, sft_steps

COMMANDS = ("ping", "generate", "teach", "train", "sft", "save", "publish", "publish_adapter", "stage_weights",
            "canary", "weight_specs", "join_update_group", "broadcast_weights")


@dataclass
class Stage:
    """A policy the group runs, with its algorithm, the behaviour tolerance of its on-policy check,
    the weight of its loss in a joint step, and the check's mask band (stages/algorithms/base.py)."""

    policy: Any
    algorithm: Any
    tolerance: float
    weight: float
    mask_limit: float | None = None
    max_masked_frac: float = 0.0


def rl_spec(recipe: Recipe, schedule_steps: int) -> OptimizerSpec:
    """The recipe's optimizer; `schedule_steps`: the length of its lr schedule (the run's, run.json)."""
    t = recipe.train
    return OptimizerSpec(lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, schedule=t.lr_schedule,
                         warmup=t.warmup_steps, total=schedule_steps, min_ratio=t.min_lr_ratio,
                         max_grad_norm=t.max_grad_norm, ema=t.ema.decay if t.ema else None)


class Worker:
    """`spec`: recipe, run storage (root, run, options), `init_weights` (a run-relative weights
    folder) or `weights_dir` (a local folder), `init_version`, `checkpoint` to restore, `scratch`,
    and `mode`: "rl" (the recipe's optimizer) or "sft" (the warm start's)."""

    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        self.recipe = recipe = Recipe.model_validate(spec["recipe"])
        self.storage = RunStorage(spec["root"], spec["run"], spec.get("options"))
        self.device = device
        self.rank, self.world = rank_of(), world_size()
        self.scratch = Path(spec["scratch"]) / f"rank{self.rank}"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.base_dir = Path(spec["weights_dir"]) if spec.get("weights_dir") else self._local_weights(spec["init_weights"])
        self.version = int(spec.get("init_version", 0))
        self.mode = spec.get("mode", "rl")
        self.family = get_family(recipe.model.kind)
        sharded = self.world > 1 and recipe.train.sharded_load
        bundle = load_bundle(self.family, self.base_dir, recipe.model, device, sharded=sharded)
        # Each policy the group runs, by stage: one ("", the recipe's) or the stages of a composed
        # shape that share one backbone, by name (a unified model's; stages/compose/).
        shape = shape_of(recipe)
        self.grouped = shape.group_stages(recipe) if shape is not None else None
        self.stages: dict[str, Stage] = {}
        for name, (part, weight) in (self.grouped or {"": (recipe, 1.0)}).items():
            policy_cls = policies.get(part.rollout.kind)
            self.stages[name] = Stage(policy_cls(self.family, bundle, part, device), get_algorithm(part.algorithm.name)(part.algorithm, part),
                                      behaviour_tolerance(part), weight, behaviour_mask_limit(part),
                                      part.rollout.behaviour_max_masked_frac)
        self._main = main = list(self.stages.values())[-1]  # of several stages, the last
        self.policy, self.algorithm = main.policy, main.algorithm
        if self.mode == "sft":
            opt, decay = type(self.policy).sft_spec(recipe)
        else:
            ema = recipe.train.ema
            opt, decay = rl_spec(recipe, self._schedule_steps()), (lambda step: self.algorithm.ema_decay(step, ema.decay)) if ema else None
        needs_reference = any(stage.algorithm.needs_reference for stage in self.stages.values())
        self.stack = TrainStack(
            self.family, bundle, mesh=mesh, device=device, spec=opt, lora=recipe.model.lora, seed=recipe.seed, ema_decay=decay,
            reference_dir=self.base_dir if self.mode == "rl" and needs_reference else None,
            reference_cfg=recipe.model, weights_dir=self.base_dir, sharded_load=sharded,
            mixed_precision=recipe.train.mixed_precision, activation_checkpointing=recipe.train.activation_checkpointing,
        )
        self._sft_info: dict[str, Any] | None = None
        # On-policy distillation's teachers (docs/distillation.md), frozen beside the student, sharded like it.
        self.teachers = self.stack.teachers
        for name, where in teacher_folders(recipe, spec["run"]).items() if self.mode == "rl" else []:
            directory = self._teacher_dir(name, where)
            self.policy.check_teacher(name, directory)
            self.teachers[name] = self.stack.frozen(directory, recipe.model)
        if spec.get("checkpoint") is not None:
            self.version = checkpoint.load(self.stack, self.storage, self.scratch, int(spec["checkpoint"]))

    @property
    def tolerance(self) -> float:
        """The behaviour tolerance of the recipe's policy (a unified model's: its last stage's)."""
        return self._main.tolerance

    @tolerance.setter
    def tolerance(self, value: float) -> None:
        self._main.tolerance = value

    def _schedule_steps(self) -> int:
        """The run's schedule length as recorded at its start (run.json), not the recipe's
        `iterations`, which an extended run changes."""
        info = self.storage.read_json("run.json") if self.storage.exists("run.json") else {}
        return int(info.get("schedule_steps") or schedule_steps(self.recipe, self.recipe.iterations))

    def _teacher_dir(self, name: str, where: str | tuple[str, str]) -> Path:
        """A teacher's local folder: its `path`, or the weights of one trained at the run's start
        (its own run folder; on an object store, a per-rank copy in the scratch folder)."""
        if isinstance(where, str):
            return Path(where)
        store = RunStorage(self.storage.root, where[0], self.storage.options)
        if (local := store.local_path(where[1])) is not None:
            return local
        return store.get_dir(where[1], self.scratch / "teachers" / name)

    def _local_weights(self, rel: str) -> Path:
        """A run folder as a local path (object stores: a per-rank copy in the scratch folder)."""
        if (local := self.storage.local_path(rel)) is not None:
            return local
        return self.storage.get_dir(rel, self.scratch / "init_weights")

    def execute(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        if cmd not in COMMANDS:
            raise ValueError(f"unknown worker command {cmd!r} (allowed: {', '.join(COMMANDS)})")
        return getattr(self, cmd)(**args)

    # -- commands ---------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {"version": self.version, "world_size": self.world}

    def _stage(self, stage: str) -> Stage:
        if stage not in self.stages:
            raise ValueError(f"this worker group runs the stages {sorted(self.stages)}, not {stage!r}")
        return self.stages[stage]

    def generate(self, iteration: int, requests: str, out_dir: str, greedy: bool = False, seed_tag: str = "",
                 stage: str = "") -> dict[str, Any]:
        """`group_size` samples per request; each rank writes `out_dir/part-{rank:03d}.arrow`.
        greedy: the policy's deterministic sampler (evaluation). Rows record the policy version.
        `stage`: the name of a unified model's stage (its shards name it, `with_stage`)."""
        start = time.perf_counter()
        policy, algorithm = self._stage(stage).policy, self._stage(stage).algorithm
        req = read_shard(self.storage, requests, "requests")
        samples = policy.samples(req, self.storage.url(requests))
        segment = policy.segment
        with self.stack.maybe_ema(algorithm.samples_with_ema and not greedy):
            rows = policy.rollout(self.stack.module, self.stack.my_share(samples), iteration=iteration, seed_tag=seed_tag,
                                  greedy=greedy, stack=self.stack, transitions=algorithm.replays_transitions)
        for row in rows:
            row.update(iteration=iteration, policy_version=self.version, parts=[segment])
        images = [c for c in IMAGE_COLUMNS if c in req.schema.names]  # copied into every row, on every rank's shard
        table = table_from_rows(rows, "rollouts", [segment], extra=images)
        write_shard(self.storage, join(out_dir, f"part-{self.rank:03d}.arrow"), with_stage(table, stage) if stage else table)
        counters = {"rows": len(rows), **policy.counters(rows)}
        totals = torch.tensor(list(counters.values()), dtype=torch.int64, device=self.device)
        self.stack.all_reduce(totals)
        return {"files": [join(out_dir, f"part-{k:03d}.arrow") for k in range(self.world)],
                **{k: int(v) for k, v in zip(counters, totals.tolist())},
                "policy_version": self.version, "seconds": time.perf_counter() - start}

    def teach(self, iteration: int, rollouts: list[str], teacher: str, out_dir: str) -> dict[str, Any]:
        """Teacher `teacher`'s scores of the student's samples routed to it (their domain's teacher,
        stages/distill.py): for text, its log-probs of every response token. Each rank scores its
        share in micro-batches of `train.micro_batch_size` and writes `out_dir/part-{rank:03d}.arrow`."""
        if teacher not in self.teachers:
            raise ValueError(f"this worker group holds the teachers {sorted(self.teachers)}, not {teacher!r}")
        start = time.perf_counter()
        table = read_rollouts(self.storage, rollouts).sort_by("sample_id")
        where = self.storage.url(rollouts[0]) + (" ..." if len(rollouts) > 1 else "")
        routed = [i for i, m in enumerate(metadata(table)) if teacher_of(self.recipe, m.get("domain")) == teacher]
        groups, counts = self.stack.cut(self.stack.my_share(routed), self.recipe.train.micro_batch_size)
        module, policy = self.teachers[teacher], self.policy
        sample_ids = table.column("sample_id").to_pylist()
        rows: list[dict[str, Any]] = []
        with torch.no_grad():
            for k in range(counts[0]):  # every rank runs as many forwards (the teacher is sharded)
                if k < len(groups[0]):
                    chunk = groups[0][k]
                    batch = policy.batches(table, [chunk], [0.0] * table.num_rows, where)[0]
                    rows += [{"sample_id": sample_ids[i], "teacher": teacher, "teacher_logprobs": lps}
                             for i, lps in zip(chunk, policy.teacher_scores(module, batch))]
                else:
                    policy.teacher_scores(module, policy.stand_in(None))
        write_shard(self.storage, join(out_dir, f"part-{self.rank:03d}.arrow"), table_from_rows(rows, "teacher"))
        totals = torch.tensor([len(rows)], dtype=torch.int64, device=self.device)
        self.stack.all_reduce(totals)
        return {"files": [join(out_dir, f"part-{k:03d}.arrow") for k in range(self.world)], "rows": int(totals[0]),
                "teacher": teacher, "seconds": time.perf_counter() - start}

    def train(self, iteration: int, rollouts: list[str], advantages: str,
              earlier: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One update: `train.updates_per_batch` optimizer steps over this rank's micro-batches of
        the batch (`rollouts`, `advantages`) and, with rollout accumulation, of the window's earlier
        batches (`earlier`: each {"rollouts": [...], "advantages": rel}, in order). Each batch is cut
        as it was sampled (so its first replay is the sampled micro-batches'); mini-batch k of the
        update is mini-batch k of every batch, its loss normalised over their union
        (stages/train/update.py)."""
        fault_point(f"train-rank{self.rank}", iteration, owner=False)
        fault_point("train-node", iteration, owner=False, node=True)
        start = time.perf_counter()
        cut = [self._cut(b["rollouts"], b["advantages"]) for b in [*(earlier or []), {"rollouts": rollouts, "advantages": advantages}]]
        updates = self.recipe.train.updates_per_batch
        parts = []
        for name in [n for n in self.stages if any(n in c for c in cut)]:  # the stages in the recipe's order
            stage, pieces = self._stage(name), [c[name] for c in cut if name in c]
            for batches, _, where in pieces:
                first = next((b[0] for b in batches if b), None)
                if first is not None:
                    stage.policy.check_batch(first, iteration, stage.algorithm, where)
            parts.append(UpdatePart(stage.policy, stage.algorithm,
                                    [[b for batches, _, _ in pieces for b in batches[k]] for k in range(updates)],
                                    [sum(counts[k] for _, counts, _ in pieces) for k in range(updates)],
                                    stage.tolerance, stage.weight, f"{name}/" if name else "", stage.mask_limit,
                                    stage.max_masked_frac))
        metrics = joint_update(self.stack, parts, iteration=iteration, seed=self.recipe.seed, version=self.version)
        self.version += 1
        return {"iteration": iteration, "policy_version": self.version, "metrics": metrics, "seconds": time.perf_counter() - start}

    def _cut(self, rollouts: list[str], advantages: str) -> dict[str, tuple[list[list[Any]], list[int], str]]:
        """One batch's micro-batches on this rank, by stage: (per mini-batch its micro-batches, per
        mini-batch the most any rank has, where the batch is stored)."""
        adv_table = read_shard(self.storage, advantages, "advantages")
        where = self.storage.url(rollouts[0]) + (" ..." if len(rollouts) > 1 else "")
        if self.grouped is None:
            tables = {"": read_rollouts(self.storage, rollouts)}
        else:
            tables = split_by_stage([read_shard(self.storage, f, "rollouts") for f in rollouts], where)
        t = self.recipe.train
        out = {}
        for name in [n for n in self.stages if n in tables]:
            stage, table = self._stage(name), tables[name].sort_by("sample_id")
            if adv_table.num_rows < table.num_rows and not name:  # dynamic sampling dropped groups
                table = table.filter(pc.is_in(table.column("sample_id"), value_set=adv_table.column("sample_id")))
            per_token = "token_advantages" in adv_table.schema.names  # on-policy distillation's (docs/distillation.md)
            table = join_on_sample_id(table, adv_table, ["token_advantages" if per_token else "advantage"],
                                      self.storage.url(advantages))
            mine = self.stack.my_share(range(table.num_rows))
            if t.max_tokens_per_micro_batch is not None and "prompt_ids" in table.column_names:  # a language model's rows by their tokens
                lengths = [len(p) + len(r) for p, r in zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())]
                groups, counts = self.stack.cut_by_tokens(mine, [lengths[i] for i in mine], t.max_tokens_per_micro_batch,
                                                          t.updates_per_batch, t.packing)
            else:
                groups, counts = self.stack.cut(mine, t.micro_batch_size, t.updates_per_batch)
            values = table.column("token_advantages").to_pylist() if per_token else table.column("advantage").to_numpy()
            out[name] = ([stage.policy.batches(table, group, values, where) for group in groups], counts, where)
        return out

    def sft(self, data: str | list[str], steps: int, batch_size: int, seed: int, start_step: int = 0,
            stages: list[str] | None = None) -> dict[str, Any]:
        """SFT steps [start_step, start_step + steps) on the records `data` (run-relative Arrow
        shards; a unified model's: one per stage, `stages` naming each): the first call prepares
        them (the policy encodes them once)."""
        if self.mode != "sft":
            raise ValueError("the sft command needs a worker group started for SFT (mode 'sft')")
        info: dict[str, Any] = {}
        policy: Any = self.policy
        if self.grouped is not None:  # one shard per stage, the stages' losses in one step
            files = dict(zip(stages or [], [data] if isinstance(data, str) else data))
            policy = self._joint = getattr(self, "_joint", None) or JointSFT(
                {name: (self._stage(name).policy, self._stage(name).weight, self.grouped[name][0].sft.batch_size) for name in files})
            if self._sft_info is None:
                tables = {name: read_shard(self.storage, rel, "sft") for name, rel in files.items()}
                self._sft_info = info = policy.sft_setup(tables, {s: self.storage.url(r) for s, r in files.items()}, self.stack, seed)
        elif self._sft_info is None:
            rel = data if isinstance(data, str) else data[0]
            table = read_shard(self.storage, rel, "sft")
            self._sft_info = info = self.policy.sft_setup(table, self.storage.url(rel), self.stack, seed)
        return {**sft_steps(self.stack, policy, start_step, steps, seed=seed, batch_size=batch_size), **info}

    def save(self) -> dict[str, Any]:
        return checkpoint.save(self.stack, self.storage, self.scratch, self.version)

    def publish(self) -> dict[str, Any]:
        """weights/v{version}, its manifest recording the canary an engine's load is verified against."""
        canary = self._canary(self.storage.weights_rel(self.version))
        return checkpoint.publish(self.stack, self.storage, self.scratch, self.version, self.export, canary)

    def publish_adapter(self) -> dict[str, Any]:
        """adapters/v{version}: the LoRA adapters alone (PEFT layout), for an engine's LoRA sync."""
        canary = self._canary(self.storage.adapters_rel(self.version))
        return publish_adapter(self.stack, self.storage, self.scratch, self.version, canary)

    def _canary(self, rel: str) -> dict[str, Any]:
        """{"canary": ...} of the policy's weights as published at `rel`, or nothing where `rel` is
        published already (publishing keeps the first)."""
        return {} if self.storage.exists(join(rel, MANIFEST)) else self.canary()

    def canary(self) -> dict[str, Any]:
        """{"canary": ...} of the policy's weights as an engine gets them (SFT's EMA where it keeps
        one, as `export` writes), or nothing where the policy has none. Every rank runs the forward."""
        module = self.stack.module
        training = module.training
        module.eval()
        try:
            with self.stack.maybe_ema(self.mode == "sft" and self.stack.ema is not None):
                canary = self.policy.canary(module)
        finally:
            module.train(training)
        return {} if canary is None else {"canary": canary}

    def stage_weights(self, folder: str, lora: bool = False, bucket_mb: int = 512) -> dict[str, Any]:
        """The fast path of a weight sync (stages/train/staging.py): every rank gathers; rank 0
        writes what the engine loads into `folder` on its host (shared memory): the full weights
        in buckets of `bucket_mb` MB in the engine's dtype (model.dtype), or with `lora` the
        adapters alone in PEFT's layout. Returns what it wrote, the host and the seconds."""
        start = time.perf_counter()
        full = self._full_state()
        ema = checkpoint.full_ema(self.stack) if self.mode == "sft" and not lora else None  # every rank gathers
        if ema is not None:  # as `export`: SFT serves its EMA
            full = {**full, **ema}
        out: dict[str, Any] = {"version": self.version, "host": socket.gethostname()}
        if self.rank == 0:
            try:
                out.update(self._write_staged(Path(folder), full, lora, bucket_mb))
            except NoRoom as exc:  # the engine's side decides: fall back to disk, or stop naming it
                out["refused"] = str(exc)
        out["seconds"] = time.perf_counter() - start
        return out

    def _write_staged(self, folder: Path, full: dict[str, torch.Tensor], lora: bool, bucket_mb: int) -> dict[str, Any]:
        """Rank 0's part of `stage_weights`."""
        if lora:
            from peft import get_peft_model_state_dict  # start-up time: peft loads on first use

            adapter = get_peft_model_state_dict(self.stack.module, state_dict=full)
            return stage_adapter(folder, adapter, cast(Any, self.stack.module).peft_config["default"])
        dtype = getattr(torch, self.recipe.model.dtype)
        tensors = self.family.served_tensors(self.stack.bundle, full, lora=self.recipe.model.lora)
        tensors = {k: v if v.dtype == dtype or not v.is_floating_point() else v.to(dtype) for k, v in tensors.items()}
        return stage_tensors(folder, tensors, bucket_mb << 20)

    # -- weights into an engine over a weight-update group (stages/engines/update_group.py) ---------
    def _full_state(self) -> dict[str, torch.Tensor]:
        """The module's full tensors, gathered on every rank (a rank-0-only gather deadlocks)."""
        # start-up time: torch loads on first use, not when a recipe is read
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast("dict[str, torch.Tensor]", get_model_state_dict(self.stack.module, options=options))

    def weight_specs(self) -> dict[str, Any]:
        """Names, dtypes and shapes of what `broadcast_weights` sends, in its order, and the backend."""
        full = self._full_state()
        names = sorted(full)
        return {"names": names, "dtypes": [dtype_name(full[n].dtype) for n in names],
                "shapes": [list(full[n].shape) for n in names], "backend": "nccl" if self.device.type == "cuda" else "gloo"}

    def join_update_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> dict[str, Any]:
        """Rank 0 joins the engine's update group as its rank 0 (blocks until the engine has)."""
        if self.rank == 0:
            self._update_groups = getattr(self, "_update_groups", {})
            self._update_groups[group_name] = init_group(backend=backend, master_address=master_address,
                                                         master_port=master_port, world_size=world_size, rank=0,
                                                         group_name=group_name)
        return {"group": group_name}

    def broadcast_weights(self, group_name: str) -> dict[str, Any]:
        """Every rank gathers the full weights; rank 0 broadcasts them (sorted by name) to the
        engine, and returns their checksum."""
        start = time.perf_counter()
        full = self._full_state()
        out: dict[str, Any] = {"version": self.version}
        if self.rank == 0:
            tensors = [full[n].to(self.device).contiguous() for n in sorted(full)]
            broadcast(tensors, self._update_groups[group_name])
            out["weights_sha256"] = tensors_checksum(full.items())
        out["seconds"] = time.perf_counter() - start
        return out

    def export(self, local: Path, full: dict[str, torch.Tensor], ema_full: dict[str, torch.Tensor] | None) -> None:
        """The family's plain folder of the policy (adapters merged). SFT publishes its EMA when it
        keeps one; RL publishes the policy and, with `train.ema`, the EMA under `ema/`."""
        bundle, lora = self.stack.bundle, self.recipe.model.lora
        if self.mode == "sft" and ema_full is not None:
            self.family.export(bundle, local, {**full, **ema_full}, lora=lora)
            return
        self.family.export(bundle, local, full, lora=lora)
        if ema_full is not None:
            self.family.export(bundle, local / "ema", {**full, **ema_full}, lora=lora)


class Members:
    """Several models in one worker group (a prompt enhancer's `pe.placement: shared`): one Worker
    per member on the same ranks, each with its own recipe, run storage, weights, optimizer and
    checkpoints; every command names its member (`member`)."""

    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        common = {k: v for k, v in spec.items() if k != "members"}
        self.workers = {name: Worker({**common, **member, "scratch": str(Path(spec["scratch"]) / name)}, mesh, device)
                        for name, member in spec["members"].items()}

    @property
    def version(self) -> dict[str, int]:
        return {name: worker.version for name, worker in self.workers.items()}

    def execute(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        args = dict(args)
        name = args.pop("member", None)
        if name not in self.workers:
            raise ValueError(f"this worker group holds the members {sorted(self.workers)}; command {cmd!r} named {name!r}")
        return self.workers[name].execute(cmd, args)


def make_worker(spec: dict[str, Any], mesh: Any, device: torch.device) -> Worker | Members:
    """What a rank holds: one model's Worker, or a shared group's Members (spec `members`)."""
    return Members(spec, mesh, device) if "members" in spec else Worker(spec, mesh, device)

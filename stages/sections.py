"""The recipe's sections that every shape of run shares, and the discriminated unions built from
the registries (`model` by family, `data` by prompt source, `rollout` by policy, `algorithm`):
what `Recipe` (stages/recipe.py) and the composed shapes' sections (stages/compose/) are made of.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from unirl.stages.runtime.config_base import EMAConfig, Section
from unirl.stages.runtime.multinode import AgentsConfig, RendezvousConfig
from unirl.stages.runtime.processes import Limits
from unirl.stages.runtime.registry import algorithms, families, policies, sources
from unirl.stages.runtime.scorers import scorer_names

if TYPE_CHECKING:  # unions of the registered entries' sections, built at import
    ModelConfig = Any
    DataConfig = Any
    RolloutConfig = Any
    AlgorithmConfig = Any
else:
    ModelConfig = families.union("config", "kind")
    DataConfig = sources.union("config", "name")
    RolloutConfig = policies.union("rollout_config", "kind")
    AlgorithmConfig = algorithms.union("config", "name")


class ScorerSpec(Section):
    name: str = Field(description="Registered scorer name (see `unirl validate` errors for the list).")
    key: str | None = Field(
        None, description="Name of its reward component (`reward/<key>`); empty: the scorer name. Two scorers of the "
        "same name need different keys.",
    )
    weight: float = Field(1.0, description="Weight in the weighted sum.")
    params: dict[str, Any] = Field(default_factory=dict, description="Scorer-specific options (checked against its schema).")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        """Checked with the structural errors, not after they are fixed (what the scorer reads is
        checked against the model later, in the recipe's own check)."""
        if name not in scorer_names():
            import difflib  # start-up time: loaded on first use

            close = difflib.get_close_matches(name, scorer_names(), n=1, cutoff=0.75)
            raise ValueError(f"unknown scorer {name!r}{f'; did you mean {close[0]!r}?' if close else ''} "
                             f"(allowed: {', '.join(scorer_names())})")
        return name

    @property
    def component(self) -> str:
        return self.key or self.name


class OverlongConfig(Section):
    """What responses that hit `rollout.max_new_tokens` (finish_reason `length`) get (stages/rewards/overlong.py)."""

    truncated: Literal["keep", "zero", "soft"] = Field(
        "keep",
        description="keep: reward unchanged; zero: reward 0; soft: DAPO's soft overlong punishment added "
        "(0 up to max_new_tokens - buffer tokens, then linear down to -penalty at max_new_tokens).",
    )
    buffer: int = Field(4, ge=1, description="DAPO's L_cache: tokens of the soft penalty ramp (at most rollout.max_new_tokens).")
    penalty: float = Field(1.0, ge=0, description="Scale of the soft penalty: a full-length response gets -penalty added.")


class RewardConfig(Section):
    """Scorers and how they combine into one reward."""

    scorers: list[ScorerSpec] = Field(
        default_factory=lambda: [ScorerSpec(name="exact_match")], min_length=1, description="Scorers to run."
    )
    aggregation: Literal["weighted_sum", "mean", "min", "max"] = Field("weighted_sum", description="How scorer totals combine.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="What truncated (overlong) responses get.")


class AdvantageConfig(Section):
    """Group-relative advantages (docs/architecture.md, "The math contract", `group_advantages`)."""

    scope: Literal["group", "global"] = Field("group", description="Baseline over the prompt group or the batch.")
    normalize: bool = Field(True, description="Divide by the standard deviation.")
    use_global_std: bool = Field(False, description="Divide by the batch std instead of the group std.")
    eps: float = Field(1e-6, gt=0, description="Added to the std.")


class SFTConfig(Section):
    """Supervised warm start before RL: its weights become the run's initial weights v000000."""

    source: Literal["synthetic", "file"] = Field("synthetic", description="`synthetic`: the recipe's data source with its answers; `file`: `path`.")
    path: str | None = Field(None, description="JSONL or Arrow file of prompt/response records (source: file).")
    examples: int = Field(2000, ge=1, description="Synthetic examples to draw.")
    noise: float = Field(
        0.0, ge=0, le=1,
        description="Fraction of synthetic demonstrations carrying an imperfect teacher's slip: arithmetic answers end in "
        "a stray '=' (toy_vqa answers in '.'), toy video clips move the opposite way, toy-GenEval images show one object "
        "group in another colour than the prompt says.",
    )
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per step (all ranks together).")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    seed: int = Field(0, ge=0, description="Seed of the example order.")


class TeacherConfig(Section):
    """A teacher of on-policy distillation: a local folder of a model the student's family loads
    (any size that shares the student's tokenizer), or one SFT-trained on a domain's data at the
    run's start (`sft`, the run's `model` architecture unless `tiny` is given)."""

    name: str = Field(description="The teacher's name (lowercase letters, digits, '_'): domains and `distill.teacher` "
                      "name it, rows record it.")
    path: str | None = Field(None, description="A local folder of the teacher's weights (the student's family's layout).")
    sft: SFTConfig | None = Field(None, description="Train the teacher at the run's start instead: a warm start of its "
                                  "own on `domain`'s data (e.g. `noise: 0`, more steps than the student's).")
    domain: str | None = Field(None, description="With `sft`: the domain whose data it is trained on (empty: the "
                               "domain naming it; a single-source run's `data`).")
    tiny: dict[str, Any] | None = Field(None, description="With `sft`: architecture overrides of the teacher's tiny model "
                                        "(model.tiny's fields; a bigger teacher than the student).")
    init: Literal["base", "student"] = Field(
        "base", description="With `sft`: the weights its SFT starts from. base: the run's base model, as the student's "
        "SFT does; student: the student's initial weights (weights/v000000, after the student's SFT), its VAE kept: a "
        "flow teacher must share the student's latent space, and a tiny flow model's VAE is learnt in its SFT. With "
        "`tiny` (a flow family's transformer fields): a fresh transformer of that size beside the student's VAE and "
        "text encoders.")

    @field_validator("name")
    @classmethod
    def _plain(cls, name: str) -> str:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name):
            raise ValueError(f"{name!r} is not a teacher name; use lowercase letters, digits and '_' (at most 32, starting "
                             "with a letter)")
        return name

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if (self.path is None) == (self.sft is None):
            raise ValueError(f"teacher {self.name!r}: give exactly one of `path` (a local folder) and `sft` (trained at the "
                             "run's start)")
        if self.sft is None and (self.domain is not None or self.tiny is not None or self.init != "base"):
            raise ValueError(f"teacher {self.name!r}: `domain`, `tiny` and `init` describe a teacher trained with `sft`; "
                             "remove them")
        return self


class DistillConfig(Section):
    """On-policy distillation (docs/distillation.md): the student samples, a teacher scores the
    student's own tokens (text: its log-probs; flow: its velocity at the student's states)."""

    teachers: list[TeacherConfig] = Field(min_length=1, max_length=16, description="The teachers, by name.")
    teacher: str | None = Field(None, description="The teacher of rows whose domain names none (a single-source run's "
                                "teacher); empty: the only teacher when there is one.")
    mode: Literal["pure", "additive"] = Field(
        "pure", description="pure: the per-token reverse-KL estimate coef*(log p_teacher - log p_student) is the "
        "advantage (no reward in it); additive: it is added to the algorithm's advantage (slime's form).")
    coef: float = Field(1.0, gt=0, description="Weight of the distillation signal.")

    @model_validator(mode="after")
    def _names(self) -> DistillConfig:
        names = [t.name for t in self.teachers]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"distill.teachers.{i}.name: {name!r} names two teachers")
        if self.teacher is not None and self.teacher not in names:
            raise ValueError(f"distill.teacher: {self.teacher!r} is not one of distill.teachers ({', '.join(names)})")
        return self

    def get(self, name: str) -> TeacherConfig:
        return next(t for t in self.teachers if t.name == name)


class EvalConfig(Section):
    """Held-out evaluation: greedy accuracy and avg@k / pass@k of sampled answers."""

    every: int = Field(0, ge=0, description="Evaluate every N policy versions (updates: iterations, or windows of "
                       "train.accumulate_rollouts iterations; 0: only before and after training).")
    scorer: str | None = Field(
        None, description="Registered scorer whose score 1 means a correct answer; empty: the first of reward.scorers "
        "(with its params).",
    )
    scorer_params: dict[str, Any] = Field(
        default_factory=dict, description="Params of eval.scorer, checked against its schema as reward.scorers[].params are "
        "(e.g. {mode: strict} for geneval, {url: ...} for remote).",
    )
    k: int = Field(4, ge=1, description="Samples per prompt for avg@k and pass@k.")
    enabled: bool = Field(True, description="Evaluate before the first and after the last iteration.")
    test: bool = Field(
        True, description="With `enabled`, also evaluate the data's test split before and after RL, reported once after "
        "RL (`test/*`); the dev split is what runs report meanwhile (`eval/*`) and what recipes are tuned on.")


class TrainConfig(Section):
    """The optimizer and the worker group."""

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward on each rank.")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Cut a language model's micro-batches by tokens instead of rows: rows taken longest "
        "first while rows x the longest row (with `packing`: the rows' tokens summed) stay within this budget; a longer "
        "row trains alone. Replaces `micro_batch_size` for training; the same optimizer steps over the same rows, so the "
        "same loss and gradient (docs/scaling.md). Empty: `micro_batch_size` rows.")
    packing: bool = Field(
        False, description="A language model's micro-batch forward without padding: its rows concatenated into one "
        "sequence, positions restarting per row, attention kept inside each row (varlen flash-attention on GPU, a "
        "block-diagonal mask on CPU); the log-probs of the padded forward. Text models (not images' rows).")
    logprob_chunk_tokens: int | None = Field(
        None, ge=1, description="Token log-probs of language models (training, the behaviour replay, reference and teacher "
        "forwards, SFT) on response positions only, from the last hidden states, the output head applied this many tokens "
        "at a time (recomputed in the backward): one chunk's logits instead of rows x tokens x vocabulary. Empty: the "
        "whole logits tensor (docs/scaling.md).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations (decoder layers, transformer blocks) in the backward "
        "instead of keeping them: activation memory of about one block instead of all, for about one more forward of "
        "compute. Every family; with FSDP2, LoRA and EMA (docs/scaling.md).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm; a non-finite norm skips the step.")
    updates_per_batch: int = Field(1, ge=1, description="Optimizer steps per batch (disjoint mini-batches).")
    accumulate_rollouts: int = Field(
        1, ge=1, description="Rollout batches (iterations) per update: each of M consecutive iterations samples, scores "
        "and computes advantages on its own; the last one's train step updates on all M batches as one, the loss "
        "normalised over their union; `iterations` must be a multiple. Policy versions, checkpoints, the lr "
        "schedule and max_staleness count updates (docs/accumulation.md).")
    nnodes: int = Field(
        1, ge=1, description="Nodes of the worker group: one torchrun agent each, all joining one c10d rendezvous "
        "(train.rendezvous, train.agents; docs/deploy.md).")
    nproc_per_node: int = Field(1, ge=1, description="Ranks of each node (formerly `train.nproc`, still accepted).")
    min_nnodes: int | None = Field(
        None, ge=1, description="Elastic groups: start with as few as this many nodes when not all train.nnodes "
        "come (after train.rendezvous.last_call_s); a checkpoint resumes at any node count. Empty: exactly nnodes.")
    rendezvous: RendezvousConfig = Field(default_factory=RendezvousConfig, description="The c10d rendezvous of the nodes.")
    agents: AgentsConfig = Field(default_factory=AgentsConfig, description="How the nodes' torchrun agents start.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend (auto: nccl on GPU, else gloo).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant; linear warm-up then linear decay; cosine with warm-up."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps of the schedule.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of lr (linear/cosine).")
    ema: EMAConfig | None = Field(None, description="Keep an EMA of the trainable weights.")
    startup_timeout_s: float = Field(300.0, gt=0, description="How long the worker group may take to load the model.")
    sharded_load: bool = Field(
        True, description="With 2+ ranks, build the model on the meta device and read only each rank's FSDP2 shards from "
        "the safetensors files (a host holds about one copy of the weights); false: every rank loads the whole model.")
    mixed_precision: Literal["off", "bf16"] = Field(
        "off", description="FSDP2 mixed precision: bf16 parameters in forward and backward, fp32 gradient reduction; "
        "weights and optimizer stay in model.dtype (use with float32). Any world size; needs the worker group.")

    @model_validator(mode="before")
    @classmethod
    def _old_nproc(cls, data: Any) -> Any:
        """`nproc` is the name recipes used before multi-node groups: it means nproc_per_node."""
        if isinstance(data, dict) and "nproc" in data:
            data = dict(data)
            nproc = data.pop("nproc")
            if "nproc_per_node" in data and data["nproc_per_node"] != nproc:
                raise ValueError(f"train.nproc: {nproc!r} is the old name of train.nproc_per_node, which is also given "
                                 f"({data['nproc_per_node']!r}); keep only nproc_per_node")
            data["nproc_per_node"] = nproc
        return data

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("AdamW betas must each lie in [0, 1)")
        return betas

    @property
    def world_size(self) -> int:
        """Ranks of the whole group at its full size."""
        return self.nnodes * self.nproc_per_node


class StorageConfig(Section):
    """Where runs live: any fsspec URL."""

    root: str = Field("runs", min_length=1, description="Local path, file://, s3://bucket/prefix or memory:// (single process only).")
    options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options (e.g. s3 client_kwargs).")
    shared: bool = Field(
        False, description="A local `root` is a shared filesystem mounted at the same path on every node (NFS, "
        "Lustre...): needed for a local root when train.nnodes > 1.")

    @field_validator("root")
    @classmethod
    def _known_protocol(cls, root: str) -> str:
        """A URL's protocol must be one fsspec has an installed filesystem for (s3 needs s3fs)."""
        import fsspec  # start-up time: fsspec loads on first use, not when a recipe is read
        from fsspec.core import split_protocol

        protocol, _ = split_protocol(root)
        if protocol is not None:
            try:
                fsspec.get_filesystem_class(protocol)
            except (ValueError, ImportError) as exc:
                raise ValueError(f"no filesystem for {protocol + '://'!r} ({' '.join(str(exc).split())[:160]}); "
                                 "use a local path, file://, s3:// or memory://") from None
        return root


class TrackingConfig(Section):
    """MLflow."""

    mlflow_uri: str | None = Field(
        None, description="Tracking URI; empty: $MLFLOW_TRACKING_URI, else one SQLite store for every run of the storage "
        "root (<root>/mlflow.db, local storage) or ./mlruns.db."
    )
    experiment: str | None = Field(
        None, min_length=1, description="MLflow experiment name; empty: the recipe's name (one experiment per recipe, so "
        "its runs sit in one table and on one chart).")
    system_metrics: bool = Field(
        True, description="Log MLflow system metrics (CPU, memory, disk, network; GPU where present) every 10 s "
        "($MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL) as system/*.")
    preview_every: int = Field(
        1, ge=0, description="Log what people should see of an iteration's rollouts every N iterations (0: never): a "
        "samples table (prompt, response or picture, reward, advantage, version), and an image grid for flow models.",
    )
    registry: bool = Field(
        True, description="Register every published weights version in the MLflow Model Registry under the recipe's name.")


def _fill_rollout_kind(data: Any) -> Any:
    """`rollout.kind` is the model family's policy: the rollout section's fields are that
    policy's (an image model's recipe cannot carry text-sampling fields, nor the reverse)."""
    if not isinstance(data, dict):
        return data
    model = data.get("model") or {}
    kind = model.get("kind", "qwen3") if isinstance(model, dict) else getattr(model, "kind", None)
    if not isinstance(kind, str) or kind not in families:
        return data  # the model union reports the unknown kind
    rollout = data.get("rollout")
    if rollout is None:
        rollout = {}
    if isinstance(rollout, dict) and "kind" not in rollout:
        data = {**data, "rollout": {**rollout, "kind": families.get(kind).policy}}
    return data


PART_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_part_name(name: str) -> str:
    """A part's name is a folder under the run's `parts/`, a column namespace and a metric key:
    lower-case letters, digits and '_', starting with a letter."""
    if not PART_NAME.fullmatch(name or ""):
        raise ValueError(f"{name!r} is not a part name; use lower-case letters, digits and '_' (at most 32, starting "
                         "with a letter)")
    return name


class NamedPart(Section):
    """What every part (stage) of a composed recipe has first: its name."""

    name: str = Field(description="The part's name: its folder (a pipeline's `parts/<name>`, a unified model's "
                      "`rollouts/<name>`), its columns in composed rows, its metrics (`train/<name>/...`) and tasks "
                      "(`generate-<name>`).")

    @field_validator("name")
    @classmethod
    def _part_name(cls, name: str) -> str:
        return check_part_name(name)


def _variable_names(names: list[str]) -> list[str]:
    bad = [n for n in names if not n or not (n[0].isalpha() or n[0] == "_") or not n.replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"{bad}: environment variable names (letters, digits and _, not starting with a digit)")
    return names


class ToolLimits(Section):
    """What a sandboxed tool server may use (stages/tools/sandbox.py); a server past a limit is
    stopped, the call that was running answers why, and the server is started again."""

    cpu_s: int = Field(Limits.cpu_s, ge=1, description="CPU seconds each of its processes may use in its lifetime.")
    memory_mb: int = Field(Limits.memory_mb, ge=64, description="Memory: an allocation past it fails in the process that asks; all "
                           "its processes together resident past it stop the server.")
    files: int = Field(Limits.files, ge=16, description="Open files per process.")
    procs: int = Field(Limits.procs, ge=2, description="Processes at once (the server's own included).")


class MCPServerConfig(Section):
    """An MCP server over stdio whose tools the policy may call."""

    name: str = Field(description="What the run calls it (logs, errors).")
    command: list[str] = Field(min_length=1, description="Its command line, e.g. [python, -m, my_tools.server] (`python` "
                               "first: the run's own interpreter).")
    env: dict[str, str] = Field(default_factory=dict, description="Variables it gets (values written here; the run's own "
                                "environment does not reach a tool server).")
    pass_env: list[str] = Field(default_factory=list, description="Names of the run's environment variables it gets "
                                "(a credential a tool needs, named knowingly).")

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        return _variable_names(names)

    @field_validator("name")
    @classmethod
    def _plain(cls, name: str) -> str:
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{name!r}: letters, digits, - and _ only")
        return name


class AgentConfig(Section):
    """Multi-turn rollouts with tools: the policy writes a turn, its tool calls run, their results
    come back as a tool turn, until it answers (docs/agentic.md)."""

    tools: list[str] = Field(default_factory=list, description="Registered Python tools (stages/tools: @register_tool), "
                             "served by unirl's own MCP server.")
    mcp_servers: list[MCPServerConfig] = Field(default_factory=list, description="More tools, from MCP servers over stdio.")
    max_turns: int = Field(4, ge=1, le=64, description="Assistant turns of a trajectory at most.")
    timeout_s: float = Field(10.0, gt=0, description="Longest a tool call may take (the server is started again after).")
    max_chars: int = Field(1024, ge=16, description="Characters of a tool result the policy reads at most (the rest is cut).")
    sandbox: bool = Field(True, description="Run tool servers with no network, no writes outside a scratch folder, their "
                          "own process namespace and `limits` (needs CAP_SYS_ADMIN or user namespaces; a run whose "
                          "sandbox cannot be made stops, naming the step).")
    limits: ToolLimits = Field(default_factory=ToolLimits, description="What a sandboxed tool server may use.")
    pass_env: list[str] = Field(default_factory=list, description="Names of the run's environment variables unirl's "
                                "server of Python tools gets (nothing else of the run's environment reaches it).")
    restarts: int = Field(3, ge=0, description="Times in a row a tool server that died or hung is started again with no "
                          "call answered in between (then every call answers that it is down).")

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        return _variable_names(names)

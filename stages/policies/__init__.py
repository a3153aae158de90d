"""The policy seam: how a model turns conditions (prompts) into a generated segment and replays it.

A policy is one file here that registers a `Policy` subclass; a model family names the policy
it offers (`Family.policy`). Two exist: `text` (autoregressive tokens, stages/policies/text.py)
and `flow` (flow-matching latents, 4-D images or 5-D video, stages/policies/flow.py).

    encode(prompts)                       -> conditions (token ids; prompt embeddings)
    rollout(module, samples, ...)         -> segment rows, with the behaviour log-probs recorded at
                                             sampling time, and the batches to train on
    batch(table, rows)                    -> a micro-batch read back from a stored shard (replay needs
                                             nothing but the shard)
    replay(module, batch, selection)      -> log-probs (plus means / std for flow policies)
    decode(...)                           -> media for scorers and people

Each policy also owns its recipe section (`rollout:`, the union member whose `kind` is the
policy's name: text sampling fields for `text`, SDE fields for `flow`) and its supervised
objective for SFT.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from unirl.stages.algorithms.correction import CorrectionConfig
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import engines, policies
from unirl.stages.runtime.sample import (
    first_of_groups,  # noqa: F401 (re-exported)
    read_rollouts,
    read_shard,
    scoring_view,
)

if TYPE_CHECKING:
    EngineConfig = Any  # the union of the registered engines' sections, built at import
else:
    EngineConfig = engines.union("config", "name")


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: drop groups whose rewards are all equal and refill with new prompts.
    If no group is informative after `max_rounds`, the iteration trains on the first round's groups
    (all advantages 0): not a no-op, since AdamW's momentum and weight decay, the schedule and a KL
    term still act; the metric `rollout/no_signal` marks it."""

    max_rounds: int = Field(3, ge=1, description="Generation rounds per iteration at most (the cap).")


class RolloutBase(Section):
    """How samples are generated: the fields every policy shares."""

    prompts_per_iteration: int = Field(8, ge=1, le=1 << 20, description="Prompt groups per iteration.")
    group_size: int = Field(4, ge=1, le=4096, description="Samples per prompt (the GRPO group).")
    dynamic_sampling: DynamicSamplingConfig | None = Field(None, description="DAPO dynamic sampling.")
    engine: EngineConfig = Field(default_factory=lambda: engine_config_default(), description="Where rollouts are sampled.")
    behaviour_tolerance: float | None = Field(
        None, ge=0,
        description="Largest |replayed - recorded| behaviour log-prob the first update accepts before failing "
        "(empty: the engine's or the policy's measured default, see docs/extending.md). Only rows sampled by the "
        "weights being trained are held to it; rows of older versions are measured (train/behaviour_logp_*).",
    )
    behaviour_mask_limit: float | None = Field(
        None, ge=0,
        description="A token of a row the trained weights sampled whose |replayed - recorded| log-prob is above the "
        "tolerance but at most this is masked out of the loss (advantage 0) and counted (train/behaviour_masked_frac) "
        "instead of failing the run; above it the update fails (empty: the policy's default, 1e-2 for text in fp32, "
        "1.0 in bf16; flow policies replay exactly and mask nothing; docs/extending.md, 'The behaviour check').",
    )
    behaviour_max_masked_frac: float = Field(
        0.2, ge=0, le=1,
        description="The update fails when more than this fraction of the samples a rank checks in it had a token "
        "masked: rounding leaves a few tokens a hair off their record, a real misalignment many.",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: each iteration samples, then trains; async: a producer flow keeps sampling later "
        "iterations on a dedicated engine while the trainer trains (docs/engines.md). async needs rollout.correction.")
    max_staleness: int = Field(
        1, ge=0, description="async: iteration k, trained at policy version v (k, or k // train.accumulate_rollouts), "
        "trains on rollouts of version >= v - max_staleness; the producer samples it with version max(0, v - "
        "max_staleness), and older rows are dropped and counted.")
    correction: CorrectionConfig | None = Field(
        None, description="Off-policy correction of rows whose behaviour log-probs differ from the trainer's "
        "(stages/algorithms/correction.py); empty: every row must be on-policy.")

    @model_validator(mode="after")
    def _mask_band(self) -> RolloutBase:
        tol, limit = self.behaviour_tolerance, self.behaviour_mask_limit
        if tol is not None and limit is not None and limit < tol:
            raise ValueError(f"rollout.behaviour_mask_limit: {limit:g} is below rollout.behaviour_tolerance ({tol:g}); "
                             "tokens up to the tolerance train, those above it up to the mask limit are masked: raise it")
        return self


def engine_config_default() -> Section:
    return engines.get("trainside").config()


class Policy(ABC):
    kind: ClassVar[str]
    # The segment kind of the rows it writes and what the metrics of an update are weighted by
    # ("tokens", "samples").
    segment: ClassVar[str]
    weight_name: ClassVar[str]
    rollout_config: ClassVar[type[RolloutBase]]
    # Its segment's columns in a rollout shard (stages/runtime/sample.py `segment_columns`).
    columns: ClassVar[dict[str, Any]]
    # "module:Class" of how its requests and rows are spoken to a dedicated engine (`for_engine`,
    # stages/engines/) and of its backend in unirl's engine server (`serve`, stages/engine_server/).
    wire: ClassVar[str]
    server_backend: ClassVar[str]
    # Its SFT setup runs before the other stages' on a backbone it shares (a unified model): the
    # flow policy warms a tiny model's VAE up there, before any stage encodes media.
    sft_first: ClassVar[bool] = False

    @abstractmethod
    def __init__(self, family: Any, bundle: Any, recipe: Any, device: Any):
        """The policy of a loaded model (`bundle` of `family`) on `device`, for the recipe's section."""

    @classmethod
    def check(cls, recipe: Any) -> None:
        """Cross-section rules of a recipe using this policy; ValueError('field.path: ...')."""

    @classmethod
    def samples(cls, requests: Any, where: str) -> list[tuple[Any, ...]]:
        """(sample id, group id, prompt, metadata) for each of `group_size` samples of every
        request in a requests table, sorted by sample id (what `rollout` is given a share of)."""
        out = []
        for gid, prompt, meta, size in zip(requests.column("group_id").to_pylist(), requests.column("prompt").to_pylist(),
                                           requests.column("metadata").to_pylist(), requests.column("group_size").to_pylist()):
            out += [(f"{gid}/{j}", gid, prompt, meta) for j in range(size)]
        return sorted(out, key=lambda s: s[0])

    @classmethod
    def default_tolerance(cls, dtype: str) -> float:
        """Largest behaviour-vs-replay log-prob difference of trainside sampling at `dtype`."""
        raise NotImplementedError

    @classmethod
    def default_mask_limit(cls, dtype: str) -> float | None:
        """Largest difference a token may have and be masked instead of failing the update, at
        `dtype` (None: no mask band, as for a policy that replays exactly)."""
        return None

    def check_teacher(self, name: str, directory: Any) -> None:
        """Refuse the folder of distillation teacher `name` where it cannot teach this policy's
        model (nothing here: a text teacher's tokenizer is checked by `unirl validate`)."""

    def canary(self, module: Any) -> dict[str, Any] | None:
        """What a dedicated engine's load of these weights is verified against (stages/runtime/canary.py):
        {"tokens", "logprobs"} of the module; None where the policy has none (every rank calls it)."""
        return None

    @classmethod
    def log_preview(cls, recipe: Any, tracker: Any, storage: Any, iteration: int) -> str | None:
        """Log what people should see of an iteration's rollouts (nothing by default)."""
        return None

    @classmethod
    def log_eval_preview(cls, recipe: Any, tracker: Any, storage: Any, version: int) -> str | None:
        """Log what people should see of a held-out evaluation's samples (nothing by default)."""
        return None


PREVIEW_ROWS = 16  # rollouts in an iteration's samples table


def iteration_rollouts(storage: Any, iteration: int, read: list[str]) -> Any:
    """The scoring view of iteration `iteration`'s committed rollouts, columns `read` (None until committed)."""
    gen = storage.stage_manifest(iteration, "generate")
    return None if gen is None else scoring_view(read_rollouts(storage, gen["files"], columns=read))



SAMPLES_COLUMNS = ["sample_id", "group_id", "prompt", "policy_version"]  # what a samples table reads, besides its cells'


def samples_table(storage: Any, iteration: int, read: list[str], cells: Any, rows: int = PREVIEW_ROWS,
                  table: Any = None) -> dict[str, list[Any]] | None:
    """The table of an iteration's first rollouts (one per group first) that people read in MLflow:
    sample_id, prompt, what `cells(table, i)` gives of row i (the response; the image), reward,
    its components (`reward/<scorer>`, as the score stage stored them), advantage and the policy
    version that sampled it. `read`: the rollout columns `cells` needs;
    `table`: the rollouts (at least SAMPLES_COLUMNS and `read`) when the caller has read them.
    None until the iteration's rollouts are committed."""
    if table is None:
        table = iteration_rollouts(storage, iteration, [*SAMPLES_COLUMNS, *read])
    if table is None:
        return None
    ids = table.column("sample_id").to_pylist()
    pick = first_of_groups(table.column("group_id").to_pylist(), rows)
    prompts, versions = table.column("prompt").to_pylist(), table.column("policy_version").to_pylist()
    columns: dict[str, list[Any]] = {"sample_id": [ids[i] for i in pick], "prompt": [prompts[i] for i in pick]}
    for i in pick:
        for name, value in cells(table, i).items():
            columns.setdefault(name, []).append(value)
    for stage, kind in (("score", "rewards"), ("advantage", "advantages")):
        manifest = storage.stage_manifest(iteration, stage)
        if manifest is not None:
            shard = read_shard(storage, manifest["files"][0], kind)
            at = {sid: k for k, sid in enumerate(shard.column("sample_id").to_pylist())}
            wanted = ["reward", *(c for c in shard.column_names if c.startswith("reward/"))] if stage == "score" else ["advantage"]
            for column in wanted:
                values = shard.column(column).to_pylist()
                columns[column] = [values[at[ids[i]]] if ids[i] in at else None for i in pick]
    columns["version"] = [versions[i] for i in pick]
    return columns


def policy_for(recipe: Any) -> type[Policy]:
    """The policy a recipe's model runs as: its `rollout.kind` (the family's policy, or one of
    those a unified family offers)."""
    return policies.get(recipe.rollout.kind)


def behaviour_tolerance(recipe: Any) -> float:
    """Largest |replayed - recorded| behaviour log-prob the first update of a batch accepts for rows
    the trained weights sampled: `rollout.behaviour_tolerance`, else the engine's, else the
    policy's default at the compute dtype (bf16 mixed precision: bfloat16)."""
    tolerance = recipe.rollout.behaviour_tolerance
    if tolerance is None:
        tolerance = engines.get(recipe.rollout.engine.name).behaviour_tolerance
    return policy_for(recipe).default_tolerance(compute_dtype(recipe)) if tolerance is None else tolerance


def compute_dtype(recipe: Any) -> str:
    """The dtype the policy's forward computes in (bf16 mixed precision: bfloat16)."""
    return "bfloat16" if recipe.train.mixed_precision == "bf16" else recipe.model.dtype


def behaviour_mask_limit(recipe: Any) -> float | None:
    """The top of the behaviour check's mask band (`rollout.behaviour_mask_limit`, else the policy's
    default; None: no band), never below the tolerance."""
    limit = recipe.rollout.behaviour_mask_limit
    if limit is None:
        limit = policy_for(recipe).default_mask_limit(compute_dtype(recipe))
    return None if limit is None else max(limit, behaviour_tolerance(recipe))

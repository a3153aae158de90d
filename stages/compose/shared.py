"""What the stages of a composed shape that share one backbone share (a unified model's,
unified.py): each stage's rollout shards named by their stage, read back by stage for the joint
train step, and the joint warm start (every stage's supervised loss in one optimizer step)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    import torch


STAGE_KEY = b"unirl.stage"  # a stage's rollout shard: the stage that sampled it


class JointSFT:
    """The joint warm start as one policy to `sft_steps`: each step's loss is the sum of each
    stage's supervised loss (cross-entropy on plans, flow matching on images) times its weight,
    one backward and one optimizer step on the shared weights."""

    weight_name = "samples"

    def __init__(self, stages: dict[str, tuple[Any, float, int]]):
        self.stages = stages  # name -> (policy, loss weight, records per step)
        self.batch_sizes: dict[str, int] = {}

    def sft_setup(self, tables: dict[str, pa.Table], where: dict[str, str], stack: Any, seed: int) -> dict[str, Any]:
        info: dict[str, Any] = {}
        # A stage whose policy must prepare the backbone first (`Policy.sft_first`) goes first.
        for name in sorted(tables, key=lambda n: not self.stages[n][0].sft_first):
            policy, _, batch_size = self.stages[name]
            info.update(policy.sft_setup(tables[name], where[name], stack, seed))
            self.batch_sizes[name] = batch_size
        return info

    def sft_loss(self, module: Any, step: int, *, seed: int, batch_size: int, stack: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum over the stages of weight * loss (each at its own batch size); the value summed over
        ranks likewise."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        total: Any = 0.0
        value: Any = 0.0
        for name, size in self.batch_sizes.items():
            policy, weight, _ = self.stages[name]
            loss, v = policy.sft_loss(module, step, seed=seed, batch_size=size, stack=stack)
            total = total + weight * loss
            value = value + weight * torch.as_tensor(v, dtype=torch.float64).detach()
        return total, value


def with_stage(table: pa.Table, stage: str) -> pa.Table:
    """A rollout shard marked as stage `stage`'s (`split_by_stage` reads it)."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), STAGE_KEY: stage.encode()})


def split_by_stage(tables: list[pa.Table], where: str) -> dict[str, pa.Table]:
    """Rollout shards by the stage that sampled them (`with_stage`); a shard that names none is an
    error naming it."""
    import pyarrow as pa  # start-up time: loaded on first use, not when a recipe is read

    out: dict[str, list[pa.Table]] = {}
    for table in tables:
        stage = (table.schema.metadata or {}).get(STAGE_KEY)
        if stage is None:
            raise ValueError(f"{where}: a unified train step reads each stage's rollout shards, and a shard names no "
                             f"stage (schema metadata {STAGE_KEY.decode()}); rerun the iteration's generate tasks")
        if table.num_rows:
            out.setdefault(stage.decode(), []).append(table)
    return {name: pa.concat_tables(parts, promote_options="default") for name, parts in out.items()}

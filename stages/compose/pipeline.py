"""Pipelines: models in sequence. The first part samples from the user's prompts, each later part
from the texts of the part before it (a prompt enhancer: a language model rewrites each prompt,
a flow-matching model draws each rewrite), and the reward on the last part's samples trains
every part that is not frozen.

Each part is a whole one-model run of its own under the pipeline run's folder
(`{run}/parts/<name>`): its recipe (`part_recipe`: the pipeline's shared sections with the part's
model, sampling, algorithm, optimizer and warm start), worker group, requests, rollouts,
advantages, checkpoints and published weights versions, so every part resumes, replays and
publishes as any run does. For parts `rewriter` then `drawer`, the pipeline's own iteration
folder holds what joins them:

    parts/rewriter/iter-N/requests.arrow   the user's prompts, N rewrites each (the first part's groups)
    parts/rewriter/iter-N/rollouts/...     the rewrites (text segments, behaviour log-probs)
    parts/drawer/iter-N/requests.arrow     one group per rewrite: M images of it
    parts/drawer/iter-N/rollouts/...       the images (latent segments)
    iter-N/rollouts/composed.arrow  one row per last-part sample with each part's sample that led
                                    to it, under the part's name (stages/runtime/sample.py)
    iter-N/rewards.arrow            the last sample's reward against the user's intent, per composed row
    parts/<name>/iter-N/advantages.arrow   per trained part, within its own groups (`part_advantages`)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from unirl.stages.compose import (
    Shape,
    chain_errors,
    duplicate_errors,
    member,
    members,
    names,
    part_of,
    parts_errors,
    per_part_errors,
    sequential_errors,
    shapes,
    where,
)
from unirl.stages.compose.chain import advantage_metrics, advantage_rows
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.stages.sections import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    NamedPart,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
    _fill_rollout_kind,
)

if TYPE_CHECKING:
    from unirl.stages.recipe import Recipe

class PipelinePart(NamedPart):
    """One part of a pipeline: its own model family, sampling, algorithm, optimizer and warm
    start, trained by its own worker group (stages/compose/pipeline.py)."""

    model: ModelConfig = Field(description="The part's model (its family decides its policy: text or flow).")
    rollout: RolloutConfig | None = Field(
        None, description="Its sampling (fields of the family's policy). The first part: group_size samples per user "
        "prompt; each later part: group_size samples per sample of the part before it, one group each "
        "(prompts_per_iteration follows from the parts before).")
    algorithm: AlgorithmConfig = Field(description="Its policy loss (one that trains the family's segment kind).")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Its optimizer and worker group.")
    sft: SFTConfig | None = Field(None, description="Its supervised warm start (empty: none).")
    data: DataConfig | None = Field(
        None, description="The prompt source of its warm start's synthetic records (empty: the recipe's `data`); a "
        "drawer learns canonical prompts here (data.name: geneval). The first part's is also where the run's prompts "
        "and held-out prompts come from.")
    freeze: bool = Field(False, description="Do not train this part (its weights stay v000000).")

    @model_validator(mode="before")
    @classmethod
    def _rollout_kind(cls, data: Any) -> Any:
        return _fill_rollout_kind(data)


class PipelineConfig(Section):
    """Models in sequence: the first samples from the user's prompts, each later one from the
    texts of the part before it (a prompt enhancer: a language model rewrites each prompt, a
    flow-matching model draws each rewrite); the reward on the last part's samples trains every
    part that is not frozen (docs/pipelines.md)."""

    members_field: ClassVar[str] = "parts"
    replaces: ClassVar[tuple[str, ...]] = ("model", "rollout", "algorithm", "train", "sft")  # its parts carry these

    kind: Literal["pipeline"] = "pipeline"
    parts: list[PipelinePart] = Field(min_length=2, max_length=8, description="The parts, in sampling order; every part "
                                      "but the last writes text (the next part's prompts).")
    placement: Literal["separate", "shared"] = Field(
        "separate", description="Where the parts train and sample: `separate`, each in its own worker group (each with its "
        "part's `train` placement); `shared`, all in one worker group on one machine (its ranks hold every model; the "
        "parts' `train.nproc_per_node` and `train.backend` must agree and `train.nnodes` be 1).")


@shapes.register("pipeline")
class Pipeline(Shape):
    config = PipelineConfig

    @classmethod
    def errors(cls, recipe: Any) -> list[str]:
        return pipeline_errors(recipe)


def parts_root(recipe: Recipe, run_name: str) -> str:
    """Where the parts' runs live: `{storage.root}/{run}/parts`."""
    return join(recipe.storage.root.rstrip("/"), run_name, "parts")


def part_recipe(recipe: Recipe, name: str, run_name: str) -> Recipe:
    """The one-model recipe of pipeline part `name` (`part_of`): the part's model, sampling,
    algorithm, optimizer, warm start and data (or the pipeline's). Its storage root is the
    pipeline run's `parts` folder and its run name the part's, so `RunStorage(root, name)` is the
    part's run. A later part samples one group per sample of the part before it; only the last
    part is scored (the others' reward is what they lead to, `part_advantages`)."""
    _, part = member(recipe, name)
    return part_of(recipe, name, model=part.model, rollout=part.rollout.model_dump(mode="json"), train=part.train,
                   sft=part.sft.model_dump(mode="json") if part.sft is not None else None, algorithm=part.algorithm,
                   data=part.data or recipe.data, storage_root=parts_root(recipe, run_name))


def part_storage(recipe: Recipe, run_name: str, name: str) -> RunStorage:
    return RunStorage(parts_root(recipe, run_name), name, recipe.storage.options)


def trains(recipe: Recipe, name: str) -> bool:
    return not member(recipe, name)[1].freeze


def pipeline_errors(recipe: Recipe) -> list[str]:
    """What `unirl validate` reports of a pipeline recipe, one `field.path: ...` line each."""
    parts, compose = members(recipe), recipe.compose
    assert isinstance(compose, PipelineConfig)
    errors = duplicate_errors(recipe) + per_part_errors(recipe, "a pipeline recipe")
    if errors:
        return errors
    errors += chain_errors(recipe, lambda name: member(recipe, name)[1].rollout.kind)
    for part in parts:
        errors += sequential_errors(recipe, part.name, part.rollout, "a pipeline samples each iteration's parts in order")
    if compose.placement == "shared":
        first = parts[0]
        for part in parts[1:]:
            for field in ("nproc_per_node", "backend"):
                if getattr(part.train, field) != getattr(first.train, field):
                    errors.append(f"{where(recipe, part.name)}.train.{field}: {getattr(part.train, field)!r}, but "
                                  f"{where(recipe, first.name)}.train.{field} is {getattr(first.train, field)!r}; with "
                                  "compose.placement: shared every part runs on the same ranks, so give all the same "
                                  "value (or set compose.placement: separate)")
        for part in parts:
            if part.train.nnodes != 1:
                errors.append(f"{where(recipe, part.name)}.train.nnodes: compose.placement: shared puts every part in one "
                              "worker group on one machine; set nnodes to 1 (or compose.placement: separate)")
    if all(part.freeze for part in parts):
        errors.append(f"compose.parts: every part is frozen ({', '.join(names(recipe))}), so nothing trains; set "
                      "`freeze: false` on one of them")
    if errors:
        return errors
    last = parts[-1]
    errors += recipe.scorer_errors(families.get(last.model.kind).produced_by(last.rollout.kind),
                                   f"{where(recipe, last.name)}.model.kind {last.model.kind!r}")
    return errors + parts_errors(recipe, lambda name: part_recipe(recipe, name, recipe.name))


def part_advantages(recipe: Recipe, storage: RunStorage, iteration: int, composed: list[str], rewards: list[str],
                    parts: dict[str, RunStorage]) -> dict[str, Any]:
    """Advantages of each trained part within its own groups (`advantage_rows`), each written to
    the part's run (`advantages.arrow`)."""
    rows = advantage_rows(recipe, storage, composed, rewards, list(parts))
    out: dict[str, Any] = {"files": [], "parts": {}, "metrics": advantage_metrics(rows)}  # files of the parts' runs, by name
    for name, part in parts.items():
        rel = join(iter_dir(iteration), "advantages.arrow")
        write_shard(part, rel, table_from_rows(rows[name], "advantages"))
        part.commit_stage(iteration, "advantage", {"files": [rel], "rows": len(rows[name])})
        out["parts"][name] = rel
    return out

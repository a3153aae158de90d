"""The one typed config: `Recipe`, loaded from YAML with `key.sub=value` overrides.

The same pydantic model is the CLI's input, the Prefect flow's parameter (so the UI renders it
as a form) and the MLflow params. Errors name the field path and the allowed values, before any
model is loaded.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from stages.config_base import Section
from stages.recipe_diffusion import (
    DiffusionSampler,
    FlowDPPOConfig,
    FlowGRPOConfig,
    GenEvalData,
    LoraConfig,
    NFTConfig,
    SD3ModelConfig,
)


class TinyQwen3(Section):
    """Architecture of the seeded random model used when `model.path` is empty (tests, smoke runs)."""

    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    num_hidden_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int = Field(16, ge=4, description="Per-head width.")
    intermediate_size: int = Field(128, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(256, ge=16, description="Longest sequence the model takes.")
    seed: int = Field(0, description="Seed of the random initialisation.")
    charset: str = Field(
        "0123456789+-*=() ", min_length=1, description="Characters of the tiny model's character-level tokenizer."
    )


class Qwen3ModelConfig(Section):
    """A Qwen3-architecture causal language model (transformers Qwen3ForCausalLM)."""

    kind: Literal["qwen3"] = Field("qwen3", description="Model family.")
    path: str | None = Field(
        None,
        description="Local directory in Hugging Face layout (config.json, *.safetensors, tokenizer). "
        "Empty: build the tiny seeded model below.",
    )
    tiny: TinyQwen3 = Field(default_factory=TinyQwen3, description="Tiny architecture, used only without `path`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the policy.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (peft) instead of all weights.")
    chat_template: bool | None = Field(
        None, description="Wrap prompts in the tokenizer's chat template (empty: when the tokenizer has one)."
    )


class ArithmeticData(Section):
    """Synthetic arithmetic prompts (`a+b=`, `12*3-40=`); the answer is the exact integer result."""

    name: Literal["arithmetic"] = "arithmetic"
    digits: int = Field(1, ge=1, le=6, description="Digits per operand (0-9 for 1, 10-99 for 2, ...).")
    operators: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    operands: int = Field(2, ge=2, le=4, description="Numbers per expression; `*` binds tighter than `+` and `-`.")
    min_value: int | None = Field(None, description="Smallest operand, overriding the low end of `digits` (may be negative).")
    max_value: int | None = Field(None, description="Largest operand, overriding the high end of `digits`.")
    template: str = Field("{expr}=", description="Prompt text; `{expr}` is replaced by the expression, e.g. 'What is {expr}? '.")
    heldout_size: int = Field(16, ge=0, description="Size of the fixed held-out split (never trained on).")
    seed: int = Field(1234, description="Seed of the prompt stream and the held-out split.")

    @model_validator(mode="after")
    def _check_space(self) -> "ArithmeticData":
        if "{expr}" not in self.template:
            raise ValueError(f"data.template: {self.template!r} has no {{expr}} placeholder")
        lo = (0 if self.digits == 1 else 10 ** (self.digits - 1)) if self.min_value is None else self.min_value
        hi = 10**self.digits - 1 if self.max_value is None else self.max_value
        if lo > hi:
            raise ValueError(f"data.min_value: {lo} is above the largest operand {hi}")
        space = len(set(self.operators)) ** (self.operands - 1) * (hi - lo + 1) ** self.operands
        if self.heldout_size >= space:
            raise ValueError(
                f"data.heldout_size: {self.heldout_size} held-out prompts leave none of the {space} possible "
                "expressions for training; lower it or widen digits / min_value / max_value / operands"
            )
        return self


class FileData(Section):
    """Prompts and reference answers from a local JSONL (one JSON object per line) or Parquet file."""

    name: Literal["file"] = "file"
    path: str = Field(description="Local .jsonl / .ndjson / .json (one object per line) or .parquet file.")
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_column: str = Field("answer", min_length=1, description="Column holding the reference answer (metadata `answer`).")
    id_column: str | None = Field(None, description="Column of unique row ids, used in prompt ids (empty: line/row number).")
    heldout_fraction: float = Field(
        0.0, ge=0, lt=1, description="Fraction of the distinct prompts held out, fixed by `seed` (0: none, or heldout_path)."
    )
    heldout_path: str | None = Field(None, description="A separate held-out file with the same columns (instead of heldout_fraction).")
    seed: int = Field(1234, description="Seed of the per-epoch shuffles and of the held-out draw.")

    @model_validator(mode="after")
    def _one_heldout(self) -> "FileData":
        if self.heldout_path is not None and self.heldout_fraction > 0:
            raise ValueError("data.heldout_fraction: set either heldout_fraction or heldout_path, not both")
        return self


DataConfig = Annotated[Union[ArithmeticData, FileData, GenEvalData], Field(discriminator="name")]
ModelConfig = Annotated[Union[Qwen3ModelConfig, SD3ModelConfig], Field(discriminator="kind")]


class RolloutConfig(Section):
    """How samples are generated."""

    backend: Literal["trainside"] = Field("trainside", description="Where generation runs: inside the training worker group.")
    prompts_per_iteration: int = Field(8, ge=1, description="Prompt groups per iteration.")
    group_size: int = Field(4, ge=1, description="Samples per prompt (the GRPO group).")
    max_new_tokens: int = Field(8, ge=1, description="Generation length cap; longer answers finish as `length`.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for training log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    dynamic_sampling: DynamicSamplingConfig | None = Field(None, description="DAPO dynamic sampling.")
    sampler: DiffusionSampler = Field(default_factory=DiffusionSampler, description="Image sampling (diffusion models only).")


class ScorerSpec(Section):
    name: str = Field(description="Registered scorer name (see `unirl validate` errors for the list).")
    weight: float = Field(1.0, description="Weight in the weighted sum.")
    params: dict[str, Any] = Field(default_factory=dict, description="Scorer-specific options.")


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
    """Group-relative advantages (DESIGN.md section 5, `group_advantages`)."""

    scope: Literal["group", "global"] = Field("group", description="Baseline over the prompt group or the batch.")
    normalize: bool = Field(True, description="Divide by the standard deviation.")
    use_global_std: bool = Field(False, description="Divide by the batch std instead of the group std.")
    eps: float = Field(1e-6, gt=0, description="Added to the std.")


class GRPOConfig(Section):
    """GRPO (DeepSeekMath) with DAPO's clip-higher; Dr.GRPO is `agg: seq_mean_token_sum_norm`."""

    name: Literal["grpo"] = "grpo"
    clip_low: float = Field(0.2, ge=0, lt=1, description="Lower clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="Upper clip: ratio <= 1 + clip_high.")
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="Loss aggregation over tokens and sequences."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the frozen initial policy (0: no reference model).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")


class GSPOConfig(Section):
    """GSPO (Zheng et al. 2025): the clipped objective on the length-normalized sequence ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1, description="Lower clip of the sequence ratio.")
    clip_high: float = Field(4e-4, ge=0, description="Upper clip of the sequence ratio.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")


class DRPOConfig(Section):
    """DRPO: ratio objective with a divergence penalty |A| w (r-1)^2 / (2 epsilon) instead of clipping."""

    name: Literal["drpo"] = "drpo"
    epsilon: float = Field(12.5, gt=0, description="Penalty temperature epsilon.")
    mu_weighted: bool = Field(True, description="Weight the penalty by the old token probability.")
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field("token_mean", description="Loss aggregation.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")


AlgorithmConfig = Annotated[
    Union[GRPOConfig, GSPOConfig, DRPOConfig, FlowGRPOConfig, FlowDPPOConfig, NFTConfig], Field(discriminator="name")
]


class EMAConfig(Section):
    """Exponential moving average of the trainable weights (published alongside the policy)."""

    decay: float = Field(0.99, gt=0, lt=1, description="EMA decay per optimizer step.")


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: drop groups whose rewards are all equal and refill with new prompts."""

    max_rounds: int = Field(3, ge=1, description="Generation rounds per iteration at most (the cap).")


class SFTConfig(Section):
    """Supervised warm start before RL: its weights become the run's initial weights v000000."""

    source: Literal["synthetic", "file"] = Field("synthetic", description="`synthetic`: the recipe's data source with its answers; `file`: `path`.")
    path: str | None = Field(None, description="JSONL or Arrow file of prompt/response records (source: file).")
    examples: int = Field(2000, ge=1, description="Synthetic examples to draw.")
    noise: float = Field(
        0.0, ge=0, le=1,
        description="Fraction of synthetic demonstrations that end in a stray '=' (an imperfect teacher's format slip).",
    )
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per step (all ranks together).")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    seed: int = Field(0, description="Seed of the example order.")


class EvalConfig(Section):
    """Held-out evaluation: greedy accuracy and avg@k / pass@k of sampled answers."""

    every: int = Field(0, ge=0, description="Evaluate every N iterations (0: only before and after training).")
    scorer: str = Field("exact_match", description="Registered scorer whose score 1 means a correct answer.")
    k: int = Field(4, ge=1, description="Samples per prompt for avg@k and pass@k.")
    enabled: bool = Field(True, description="Evaluate before the first and after the last iteration.")


class TrainConfig(Section):
    """The optimizer and the worker group."""

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward on each rank.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm; a non-finite norm skips the step.")
    updates_per_batch: int = Field(1, ge=1, description="Optimizer steps per batch (disjoint mini-batches).")
    nproc: int = Field(1, ge=1, description="Ranks in the torchrun worker group.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend (auto: nccl on GPU, else gloo).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant; linear warm-up then linear decay; cosine with warm-up."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps of the schedule.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of lr (linear/cosine).")
    ema: EMAConfig | None = Field(None, description="Keep an EMA of the trainable weights.")
    startup_timeout_s: float = Field(300.0, gt=0, description="How long the worker group may take to load the model.")


class StorageConfig(Section):
    """Where runs live: any fsspec URL."""

    root: str = Field("runs", description="Local path, file://, s3://bucket/prefix or memory:// (single process only).")
    options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options (e.g. s3 client_kwargs).")


class TrackingConfig(Section):
    """MLflow."""

    mlflow_uri: str | None = Field(
        None, description="Tracking URI; empty: $MLFLOW_TRACKING_URI, else sqlite in the run folder (local storage) or ./mlruns.db."
    )
    experiment: str = Field("unirl", description="MLflow experiment name.")


class Recipe(Section):
    """A whole RL post-training run."""

    name: str = Field("recipe", description="Recipe name; the default run name.")
    seed: int = Field(0, description="Base seed for sampling.")
    model: ModelConfig = Field(default_factory=Qwen3ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=ArithmeticData, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages.")
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig, description="Policy loss.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimizer and worker group.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Run storage.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Experiment tracking.")
    sft: SFTConfig | None = Field(None, description="Supervised warm start before RL (empty: none).")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    iterations: int = Field(3, ge=1, description="RL iterations in the run.")
    checkpoint_every: int = Field(1, ge=1, description="Save a checkpoint (and publish weights) every N iterations.")

    @model_validator(mode="after")
    def _check_combination(self) -> "Recipe":
        from stages.rewards.base import scorer_names

        known = scorer_names()
        for i, spec in enumerate(self.reward.scorers):
            if spec.name not in known:
                raise ValueError(
                    f"reward.scorers.{i}.name: unknown scorer {spec.name!r} (allowed: {', '.join(known)})"
                )
        if self.eval.scorer not in known:
            raise ValueError(f"eval.scorer: unknown scorer {self.eval.scorer!r} (allowed: {', '.join(known)})")
        families = {"qwen3": (("grpo", "gspo", "drpo"), ("arithmetic", "file")), "sd3": (("flow_grpo", "flow_dppo", "nft"), ("geneval",))}
        algos, datas = families[self.model.kind]
        if self.algorithm.name not in algos:
            raise ValueError(f"algorithm.name: {self.algorithm.name!r} does not train model.kind {self.model.kind!r} (allowed: {', '.join(algos)})")
        if self.data.name not in datas:
            raise ValueError(f"data.name: {self.data.name!r} does not feed model.kind {self.model.kind!r} (allowed: {', '.join(datas)})")
        overlong = self.reward.overlong
        if overlong.truncated == "soft" and overlong.buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong.buffer: {overlong.buffer} is longer than rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}); the soft penalty ramp must fit inside the length cap"
            )
        if self.sft is not None and self.sft.source == "file" and not self.sft.path:
            raise ValueError("sft.path: `source: file` needs the path of a JSONL or Arrow file of prompt/response records")
        return self

    def fingerprint(self) -> str:
        """sha256 of the resolved recipe, without where it is stored and tracked."""
        data = self.model_dump(mode="json", exclude={"storage": {"root", "options"}, "tracking": True, "iterations": True})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class RecipeError(ValueError):
    """A recipe that does not validate. `errors` holds one `field.path: message` line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: invalid recipe\n" + "\n".join(f"  {e}" for e in errors))


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError("overrides", [f"{text!r}: expected key.sub=value"])
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise RecipeError("overrides", [f"{text!r}: expected key.sub=value"])
    return key.split("."), yaml.safe_load(raw) if raw != "" else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `key.sub=value` paths in the raw recipe (values parsed as YAML; list items by index)."""
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError("overrides", [f"{text!r}: {'.'.join(path[:depth])} has no item {part}"])
                key: Any = int(part)
            elif isinstance(node, dict):
                key = part
                if not last and node.get(key) is None:
                    node[key] = {}
            else:
                raise RecipeError("overrides", [f"{text!r}: {'.'.join(path[:depth])} is not a section"])
            if last:
                node[key] = value
            else:
                node = node[key]
    return data


def _union_members(annotation: Any) -> list[Any]:
    out = []
    for arg in get_args(annotation):
        out.extend(_union_members(arg) if get_args(arg) else [arg])
    return [a for a in out if hasattr(a, "model_fields")]


def _tag(model: Any, key: str = "name") -> Any:
    field = model.model_fields.get(key)
    return field.default if field is not None else None


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], Any]:
    """The user-facing path of a pydantic error location (union tags dropped) and the section
    model that holds its last field (None when unknown)."""
    path: list[str] = []
    current: Any = model
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        path.append(str(part))
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(part) if parts else None
        if field is None:
            continue
        annotation = field.annotation
        members = _union_members(annotation)
        if hasattr(annotation, "model_fields"):
            current = annotation
            if field.discriminator and parts and parts[0] == _tag(annotation, field.discriminator):
                parts.pop(0)
        elif field.discriminator and parts and any(parts[0] == _tag(m, field.discriminator) for m in members):
            tag = parts.pop(0)
            current = next(m for m in members if _tag(m, field.discriminator) == tag)
        elif members:
            current = members[0]
            if parts and isinstance(parts[0], int):
                path.append(str(parts.pop(0)))
        else:
            current = None
    return path, current


def format_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One `field.path: message (allowed: ...)` line per pydantic error."""
    model = model or Recipe
    lines = []
    for err in exc.errors():
        path, section = _walk(model, tuple(err["loc"]))
        where = ".".join(path) or "(recipe)"
        msg, kind, got = err["msg"], err["type"], err.get("input")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            if ":" in msg.split(" ")[0]:  # the validator already names its field
                lines.append(msg)
                continue
        if kind == "extra_forbidden":
            allowed = sorted(section.model_fields) if section is not None else []
            msg = "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif kind in ("literal_error", "enum"):
            msg = f"invalid value {got!r} (allowed: {err.get('ctx', {}).get('expected')})"
        elif kind == "union_tag_invalid":
            ctx = err.get("ctx", {})
            msg = f"unknown {str(ctx.get('discriminator', 'name')).strip(chr(39))} {ctx.get('tag')!r} (allowed: {ctx.get('expected_tags')})"
        elif kind != "missing" and not isinstance(got, dict):
            msg = f"{msg}; got {got!r}"
        lines.append(f"{where}: {msg}")
    return lines


def build_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(source, format_errors(exc)) from None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or the defaults when `path` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise RecipeError(source, [f"no such recipe file: {p}"])
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise RecipeError(source, [f"not valid YAML: {exc}"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise RecipeError(source, ["the recipe must be a mapping of sections"])
        data = loaded
        data.setdefault("name", p.stem)
    return build_recipe(apply_overrides(data, overrides or []), source)

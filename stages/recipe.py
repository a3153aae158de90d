"""The one typed config: `Recipe`, loaded from YAML with `key.sub=value` overrides.

The same pydantic model is the CLI's input, the Prefect flow's parameter (so the UI renders it
as a form) and the MLflow params. The sections that vary are discriminated unions built from the
registries: `model` (families, by `kind`), `data` (prompt sources), `rollout` (the family's
policy: text sampling or flow sampling fields), `rollout.engine` and `algorithm`. Rules that need
two sections at once are the registered entries' own `check`s, run at validation, so errors name
the field path and the allowed values before any model is loaded.
"""
from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from unirl.stages.distill import distill_errors
from unirl.stages.runtime.accumulation import iterations_error
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.multinode import multinode_errors
from unirl.stages.runtime.registry import algorithms, engines, families, policies, shapes, sources, tools
from unirl.stages.runtime.scorers import check_scorer_params, scorer_names, scorer_reads
from unirl.stages.runtime.secrets import literal_secrets, redact_url
from unirl.stages.runtime.storage import check_run_name
from unirl.stages.runtime.yaml_input import MAX_BYTES as YAML_MAX_BYTES
from unirl.stages.runtime.yaml_input import YamlInputError, load_yaml
from unirl.stages.sections import (
    AdvantageConfig,
    AgentConfig,
    AlgorithmConfig,
    DataConfig,
    DistillConfig,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    StorageConfig,
    TrackingConfig,
    TrainConfig,
    _fill_rollout_kind,
)

if TYPE_CHECKING:  # the union of the registered composed shapes' sections (stages/compose), built at import
    Composition = Any
else:
    Composition = Union[tuple(shape.config for _, shape in shapes.items())]  # noqa: UP007 - a runtime tuple


class Recipe(Section):
    """A whole RL post-training run."""

    name: str = Field("recipe", description="Recipe name (letters, digits, '.', '_', '-'): the MLflow experiment and "
                      "registered model, and `unirl run`'s default run name (a deployment run's is its Run Name).")
    seed: int = Field(0, ge=0, description="Base seed for sampling.")
    model: ModelConfig = Field(default_factory=lambda: families.get("qwen3").config(), description="The policy model.")
    data: DataConfig = Field(default_factory=lambda: sources.get("arithmetic").config(), description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=lambda: policies.get("text").rollout_config(),
                                   description="Generation (its fields are the model family's policy's).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages.")
    algorithm: AlgorithmConfig = Field(default_factory=lambda: algorithms.get("grpo").config(), description="Policy loss.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimizer and worker group.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Run storage.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Experiment tracking.")
    sft: SFTConfig | None = Field(None, description="Supervised warm start before RL (empty: none).")
    compose: Composition | None = Field(
        None, discriminator="kind", description="A composed run instead of one model. `kind: pipeline`: models in sequence (a prompt "
        "enhancer: a rewriter, then a drawer), whose parts give the models, sampling, algorithms, optimizers and warm "
        "starts, so the recipe's own model, rollout, algorithm, train and sft stay unset. `kind: unified`: one backbone "
        "in stages (it writes a plan, then draws it): `model` is a family offering each stage's policy, `train` and "
        "`sft` its one optimizer and joint warm start; each stage's sampling and algorithm are here, so the recipe's "
        "own rollout and algorithm stay unset.")
    agent: AgentConfig | None = Field(None, description="Multi-turn rollouts with tools (text families): the policy "
                                      "writes a turn, its tool calls run, their results come back, until it answers "
                                      "(docs/agentic.md). Empty: one answer per prompt.")
    distill: DistillConfig | None = Field(
        None, description="On-policy distillation from teachers (docs/distillation.md): the student samples, each row's "
        "teacher (its domain's) scores the student's own tokens or states. Empty: none.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    iterations: int = Field(3, ge=1, le=10_000_000, description="RL iterations in the run.")
    checkpoint_every: int = Field(
        1, ge=1, description="Save a checkpoint (and publish weights) every N policy versions (updates: iterations, or "
        "windows of train.accumulate_rollouts iterations) and at the last.")

    @property
    def shape(self) -> str:
        """The run's shape (flows/shapes/): `single`, or the `compose` section's kind (stages/compose/)."""
        return "single" if self.compose is None else self.compose.kind

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        return check_run_name(name, "name")

    @model_validator(mode="before")
    @classmethod
    def _rollout_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("compose") is not None:
            return data  # the parts (stages) carry their rollout sections
        return _fill_rollout_kind(data)

    @model_validator(mode="after")
    def _check_combination(self, info: ValidationInfo) -> Recipe:
        """Every rule that needs two sections at once, so `unirl validate` finds what the run would
        otherwise meet inside the worker group; all problems are reported together. With the
        validation context `{"local_files": False}` the rules that read local model folders are
        skipped: a deployment's folders are on its workers, not where prefect.yaml is written."""
        if self.shape != "single":  # a composed recipe: its shape's own checks (stages/compose)
            errors = shapes.get(self.shape).errors(self) + accumulation_errors(self)
            if self.distill is not None:
                errors.append("distill: on-policy distillation is built for single-model runs; remove it or the compose section")
            if errors:
                raise ValueError("\n".join(errors))
            return self
        family = families.get(self.model.kind)
        produced = family.produced_by(self.rollout.kind)
        errors = self.scorer_errors((*produced, "transcript") if self.agent is not None else produced,
                                    f"model.kind {self.model.kind!r}" + (" with `agent`" if self.agent is not None else ""))
        policy = policies.get(self.rollout.kind)
        algo = algorithms.get(self.algorithm.name)
        if self.rollout.kind not in family.offers():
            errors.append(f"rollout.kind: {self.rollout.kind!r} sampling does not run model.kind {self.model.kind!r}, "
                          f"whose policy is {family.policy!r}; remove rollout.kind")
        if algo.segment != policy.segment:
            fits = [n for n, a in algorithms.items() if a.segment == policy.segment]
            errors.append(f"algorithm.name: {algo.name!r} trains {algo.segment} segments, but model.kind {self.model.kind!r} "
                          f"produces {policy.segment} segments (allowed: {', '.join(fits)})")
        if self.train.updates_per_batch > 1 and not algo.supports_multi_update:
            errors.append(f"train.updates_per_batch: algorithm {algo.name!r} takes one update per batch, not "
                          f"{self.train.updates_per_batch}; set train.updates_per_batch=1 or choose another algorithm.name")
        correction = self.rollout.correction
        if correction is not None and correction.level not in algo.correction_levels:
            takes = f"takes {', '.join(algo.correction_levels)}-level correction" if algo.correction_levels else "trains on-policy only"
            errors.append(f"rollout.correction.level: algorithm {algo.name!r} {takes}, not {correction.level!r}"
                          + ("" if algo.correction_levels else "; remove rollout.correction"))
        errors += credential_errors(self)
        errors += multinode_errors(self)
        errors += accumulation_errors(self)
        if self.sft is not None and self.sft.source == "file" and not self.sft.path:
            errors.append("sft.path: `source: file` needs the path of a JSONL or Arrow file of prompt/response records")
        if self.agent is not None:
            errors += agent_errors(self, policy)

        errors += distill_errors(self, policy, algo, local_files=(info.context or {}).get("local_files", True))
        if errors:
            raise ValueError("\n".join(errors))

        for check in (policy.check, family.check, algo.check, sources.get(self.data.name).check,
                      engines.get(self.rollout.engine.name).check):
            try:
                check(self)
            except ValueError as exc:
                errors.append(str(exc))
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def scorer_errors(self, produces: tuple[str, ...], producer: str) -> list[str]:
        """Unknown scorers, bad params, and scorers reading media that `producer` (the model that
        makes the scored samples) does not produce."""
        known = scorer_names()
        errors: list[str] = []

        def check(where: str, name: str) -> bool:
            if name not in known:
                errors.append(f"{where}: unknown scorer {name!r} (allowed: {', '.join(known)})")
                return False
            reads = scorer_reads(name)
            missing = [m for m in reads or () if m not in produces]
            if missing:
                errors.append(f"{where}: scorer {name!r} reads {', '.join(missing)}, but {producer} "
                              f"produces {', '.join(produces)}; choose a scorer that reads {', '.join(produces)}")
                return False
            return True

        seen: dict[str, int] = {}
        for i, spec in enumerate(self.reward.scorers):
            if check(f"reward.scorers.{i}.name", spec.name):
                errors += [f"reward.scorers.{i}.params.{e}" for e in check_scorer_params(spec.name, spec.params)]
            if spec.component in seen:
                errors.append(f"reward.scorers.{i}.key: scorer {spec.name!r} has the key {spec.component!r} of "
                              f"reward.scorers.{seen[spec.component]}; give one of them another `key`")
            seen.setdefault(spec.component, i)
        for d, domain in enumerate(getattr(self.data, "domains", None) or []):
            for i, spec in enumerate(domain.scorers or []):
                if check(f"data.domains.{d}.scorers.{i}.name", spec.name):
                    errors += [f"data.domains.{d}.scorers.{i}.params.{e}" for e in check_scorer_params(spec.name, spec.params)]
        if self.eval.scorer is not None:
            if check("eval.scorer", self.eval.scorer):
                errors += [f"eval.scorer_params.{e}" for e in check_scorer_params(self.eval.scorer, self.eval.scorer_params)]
        elif self.eval.scorer_params:
            errors.append("eval.scorer_params: given without eval.scorer (the first of reward.scorers is used with its own "
                          "params); name the scorer in eval.scorer or remove eval.scorer_params")
        return errors

    def eval_scorer(self, domain: str | None = None) -> tuple[str, dict[str, Any]]:
        """(name, params) of the held-out correctness scorer: `eval.scorer`, else the first scorer
        of `domain` (a mixture's domain with scorers of its own), else the first reward scorer."""
        if self.eval.scorer is not None:
            return self.eval.scorer, dict(self.eval.scorer_params)
        first = self.scorers(domain)[0]
        return first.name, dict(first.params)

    def scorers(self, domain: str | None = None) -> list[Any]:
        """The reward scorers of rows of `domain`: its own (a mixture's domain), else reward.scorers."""
        for d in getattr(self.data, "domains", None) or []:
            if d.name == domain and d.scorers:
                return list(d.scorers)
        return list(self.reward.scorers)

    def fingerprint(self) -> str:
        """sha256 of what this recipe sets away from the defaults (`non_default`), tagged with
        `FINGERPRINT_SCHEMA`, without where it is stored and tracked, how long it runs, and where
        and how it loads (nodes, ranks, how the agents start, backend, sharded loading: a run
        checkpointed at one world size resumes at another, DCP resharding it; activation
        checkpointing, which changes memory, not gradients). A field added to
        the schema at its default leaves it unchanged, so older runs resume; a recipe and its
        resolved YAML (recipe.yaml, what worker nodes load) have the same one."""
        data = non_default(self)
        for key in ("tracking", "iterations"):
            data.pop(key, None)
        storage = data.get("storage") or {}
        for key in ("root", "options", "shared"):
            storage.pop(key, None)
        if not storage:
            data.pop("storage", None)
        for section in self._sections(data):
            train = section.get("train")
            if isinstance(train, dict):
                for key in PLACEMENT:
                    train.pop(key, None)
                if not train:
                    section.pop("train")
        return hashlib.sha256(json.dumps({"schema": FINGERPRINT_SCHEMA, "recipe": data}, sort_keys=True).encode()).hexdigest()

    def _sections(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """A dump of this recipe and each of its composed members' dumps (a part or a stage)."""
        members = (data.get("compose") or {}).get(self.compose.members_field, []) if self.compose is not None else []
        return [data, *(m for m in members if isinstance(m, dict))]

    def legacy_fingerprint(self) -> str:
        """The fingerprint of runs started before `FINGERPRINT_SCHEMA` (every field, defaults
        included): such a run still resumes when its recipe is unchanged (stages/run/record.py)."""
        alone = {"accumulate_rollouts"} if self.train.accumulate_rollouts == 1 else set()
        exclude: dict[str, Any] = {"storage": {"root", "options", "shared"}, "tracking": True, "iterations": True,
                                   "train": PLACEMENT | alone}
        if self.compose is not None:
            exclude["compose"] = {self.compose.members_field: {"__all__": {"train": PLACEMENT | {"accumulate_rollouts"}}}}
        data = self.model_dump(mode="json", exclude=exclude)
        for rollout in (section.get("rollout") for section in self._sections(data)):
            if isinstance(rollout, dict):
                for key, default in {"behaviour_mask_limit": None, "behaviour_max_masked_frac": 0.2}.items():
                    if rollout.get(key, default) == default:
                        rollout.pop(key, None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def to_yaml(self) -> str:
        """The resolved recipe; a pipeline's without the one-model sections its parts replace."""
        unset = set(self.compose.replaces) if self.compose is not None else None
        return yaml.safe_dump(self.model_dump(mode="json", exclude=unset), sort_keys=False)


# The fingerprint's form: raised when a default changes what a run does, so a run started under
# the old default does not resume under the new one unnoticed.
FINGERPRINT_SCHEMA = 2
# Where and how a run loads, and what trades memory for compute without changing a gradient
# (activation checkpointing: a run that ran out of memory resumes with it): not part of its fingerprint.
PLACEMENT = frozenset({"nnodes", "nproc_per_node", "min_nnodes", "rendezvous", "agents", "backend", "startup_timeout_s",
                       "sharded_load", "activation_checkpointing"})


def non_default(model: BaseModel) -> dict[str, Any]:
    """The fields of `model` that differ from their defaults, as JSON values, sections pruned the
    same way (a section set to its default instance is left out; a list's sections are each
    pruned); a one-value `Literal` field (a union member's `kind` or `name` tag) is always kept:
    it says which variant the rest belongs to."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        tag = get_origin(field.annotation) is Literal and len(get_args(field.annotation)) == 1
        if not tag and not field.is_required():
            default = field.get_default(call_default_factory=True)
            if _json(value) == _json(default):
                continue
        out[name] = _pruned(value)
    return out


def _pruned(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return non_default(value)
    if isinstance(value, (list, tuple)):
        return [_pruned(v) for v in value]
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items()}
    return _json(value)


def _json(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    from pydantic_core import to_jsonable_python  # start-up time: pydantic_core loads on first use, not when a recipe is read

    return to_jsonable_python(value)

def accumulation_errors(recipe: Recipe) -> list[str]:
    """`train.accumulate_rollouts` (stages/runtime/accumulation.py): a run of whole windows, in a
    single-model run (a composed run's parts step once per iteration)."""
    if recipe.compose is not None:
        parts = getattr(recipe.compose, recipe.compose.members_field)
        accumulating = [f"compose.{recipe.compose.members_field}.{i}.train.accumulate_rollouts"
                        for i, part in enumerate(parts) if getattr(part, "train", None) is not None
                        and part.train.accumulate_rollouts != 1]
        if recipe.train.accumulate_rollouts != 1:
            accumulating.insert(0, "train.accumulate_rollouts")
        return [f"{field}: a composed run (compose.kind {recipe.compose.kind!r}) takes its update every iteration; "
                "rollout accumulation is built for single-model runs; set it to 1" for field in accumulating]
    error = iterations_error(recipe, recipe.iterations)
    return [] if error is None else [error]


def credential_errors(recipe: Recipe) -> list[str]:
    """A credential written into a recipe would end up in recipe.yaml, MLflow params and the
    Prefect UI: refuse it, naming the field and where it belongs instead."""
    where = "set it in the environment (AWS_* variables, a remote scorer's token_env, MLFLOW_TRACKING_* ...) or a Prefect Secret block"
    data = recipe.model_dump(mode="json")
    storage_options = literal_secrets(data["storage"].pop("options"), ".storage.options", also=("key", "username", "user"))
    out = [f"{path.lstrip('.')}: a literal credential in a recipe is written to recipe.yaml, MLflow and the Prefect UI; {where}"
           for path in literal_secrets(data, "") + storage_options]
    for field, url in (("storage.root", recipe.storage.root), ("tracking.mlflow_uri", recipe.tracking.mlflow_uri or "")):
        if url and redact_url(url) != url:
            out.append(f"{field}: {redact_url(url)!r} carries a credential; {where}")
    return out


class RecipeError(ValueError):
    """A recipe that does not validate. `errors` holds one `field.path: message` line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: invalid recipe\n" + "\n".join(f"  {e}" for e in errors))


MAX_OVERRIDE_BYTES = 64 << 10
MAX_OVERRIDES = 256  # per flow run's `overrides` parameter


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError("overrides", [f"{text!r}: expected key.sub=value"])
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise RecipeError("overrides", [f"{text!r}: expected key.sub=value"])
    if raw == "":
        return key.split("."), None
    try:
        return key.split("."), load_yaml(raw, f"override {text if len(text) <= 120 else text[:100] + '...'!r}", max_bytes=MAX_OVERRIDE_BYTES)
    except YamlInputError as exc:
        raise RecipeError("overrides", [str(exc)]) from None


# Old field names an override may still use: `train.nproc=2` sets train.nproc_per_node (so it wins
# over a recipe file that gives nproc_per_node, as any override does).
RENAMED: dict[tuple[str, ...], list[str]] = {("train", "nproc"): ["train", "nproc_per_node"]}
# Sections that became others: what a recipe written for them now says instead.
REPLACED: dict[str, str] = {
    "pe": "replaced by `compose: {kind: pipeline, parts: [...]}`: the `ar` part first, then the `diffusion` part, each "
          "with a `name`; `freeze_llm` / `freeze_diffusion` are each part's `freeze`, `placement` is compose's "
          "(docs/pipelines.md)",
    "unified": "replaced by `compose: {kind: unified, stages: [...]}`: the `ar` stage first, then the `diffusion` "
               "stage, each with a `name` and its policy in `rollout.kind` (text, flow) (docs/unified.md)",
}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `key.sub=value` paths in the raw recipe (values parsed as YAML; list items by index)."""
    for text in overrides:
        path, value = parse_override(text)
        path = RENAMED.get(tuple(path), path)
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


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], Any, list[tuple[str, Any, Any]]]:
    """The user-facing path of a pydantic error location (union tags dropped), the section model
    that holds its last field (None when unknown), and, when that section is one variant of a
    discriminated union, the other variants as (discriminator, tag, model)."""
    path: list[str] = []
    current: Any = model
    siblings: list[tuple[str, Any, Any]] = []
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
        siblings = []
        if hasattr(annotation, "model_fields"):
            current = annotation
            if field.discriminator and parts and parts[0] == _tag(annotation, field.discriminator):
                parts.pop(0)
        elif field.discriminator and parts and any(parts[0] == _tag(m, field.discriminator) for m in members):
            tag = parts.pop(0)
            current = next(m for m in members if _tag(m, field.discriminator) == tag)
            siblings = [(field.discriminator, _tag(m, field.discriminator), m) for m in members if m is not current]
        elif members:
            current = members[0]
            if parts and isinstance(parts[0], int):
                path.append(str(parts.pop(0)))
        else:
            current = None
    return path, current, siblings


def _unknown_field(path: list[str], section: Any, siblings: list[tuple[str, Any, Any]]) -> str:
    """`unknown field`, with what a person needs next: the variants that take the field (a flow
    model's `sampler` in a text model's rollout), a near-miss's likely meaning, the allowed names."""
    name, owner = path[-1], ".".join(path[:-1])
    if not owner and name in REPLACED:
        return REPLACED[name]
    allowed = sorted(section.model_fields) if section is not None else []
    takers = [repr(tag) for _, tag, member in siblings if name in member.model_fields]
    msg = "unknown field"
    if takers:
        key = siblings[0][0]
        msg += (f" for {owner}.{key} {_tag(section, key)!r}; {owner}.{key} {', '.join(takers[:6])}{' ...' if len(takers) > 6 else ''} "
                f"take{'s' if len(takers) == 1 else ''} it")
    else:
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.75)
        if close:
            msg += f"; did you mean {close[0]!r}?"
    return msg + (f" (allowed: {', '.join(allowed)})" if allowed else "")


def format_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One `field.path: message (allowed: ...)` line per pydantic error."""
    model = model or Recipe
    lines: list[str] = []
    for err in exc.errors():
        path, section, siblings = _walk(model, tuple(err["loc"]))
        where = ".".join(path) or "(recipe)"
        msg, kind, got = err["msg"], err["type"], err.get("input")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            if ":" in msg.split(" ")[0]:  # the validator already names its field (one line per problem)
                # a section's validator names its own field: put the section's path before it
                lines.extend(line if not path or line.startswith(f"{path[0]}.") or line.startswith(f"{path[0]}:")
                             else f"{where}.{line}" for line in msg.splitlines())
                continue
        if kind == "number_not_bool":  # a section's own check: the field is in ctx, not in the location
            lines.append(f"{'.'.join([*path, err['ctx']['field']])}: expected a number, got {err['ctx']['value']}")
            continue
        if kind == "extra_forbidden":
            msg = _unknown_field(path, section, siblings)
        elif kind in ("literal_error", "enum"):
            msg = f"invalid value {got!r} (allowed: {err.get('ctx', {}).get('expected')})"
        elif kind == "union_tag_invalid":
            ctx = err.get("ctx", {})
            msg = f"unknown {str(ctx.get('discriminator', 'name')).strip(chr(39))} {ctx.get('tag')!r} (allowed: {ctx.get('expected_tags')})"
        elif kind != "missing" and not isinstance(got, dict):
            msg = f"{msg}; got {got!r}"
        lines.append(f"{where}: {msg}")
    return lines


def build_recipe(data: dict[str, Any], source: str = "recipe", *, local_files: bool = True) -> Recipe:
    """`data` validated; `local_files=False` skips the checks that read the model folders it names."""
    try:
        return Recipe.model_validate(data, context={"local_files": local_files})
    except ValidationError as exc:
        raise RecipeError(source, format_errors(exc)) from None


def with_overrides(recipe: Recipe, overrides: list[str], source: str = "overrides") -> Recipe:
    """`recipe` with `key.sub=value` overrides applied as `unirl run` applies them (to the fields
    the recipe gives, so a composed recipe's unset sections stay unset), validated again."""
    if not overrides:
        return recipe
    return build_recipe(apply_overrides(recipe.model_dump(mode="json", exclude_unset=True), list(overrides)), source)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None, *, local_files: bool = True) -> Recipe:
    """Read a YAML recipe (or the defaults when `path` is None), apply overrides, validate
    (`local_files=False`: without reading the model folders it names; see build_recipe)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise RecipeError(source, [f"no such recipe file: {p}"])
        try:
            with p.open("rb") as f:  # no more than the bound: a huge file is refused unread
                loaded = load_yaml(f.read(YAML_MAX_BYTES + 1), source)
        except YamlInputError as exc:
            raise RecipeError(source, [str(exc).removeprefix(f"{source}: ")]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise RecipeError(source, ["the recipe must be a mapping of sections"])
        data = loaded
        data.setdefault("name", p.stem)
    return build_recipe(apply_overrides(data, overrides or []), source, local_files=local_files)


def agent_errors(recipe: Recipe, policy: Any) -> list[str]:
    """The `agent` section's rules: text policies only, tools that are registered (their schemas
    were checked when they registered), MCP servers with distinct names."""
    agent = recipe.agent
    assert agent is not None
    errors = []
    if policy.segment != "text":
        errors.append(f"agent: multi-turn tool use samples text, but model.kind {recipe.model.kind!r} samples "
                      f"{policy.segment}; remove agent")
    try:
        known = tools.names()
    except ValueError as exc:  # a registered tool whose schema cannot be made
        return [*errors, f"agent.tools: {exc}"]
    for i, name in enumerate(agent.tools):
        if name in tools.refused:
            errors.append(f"agent.tools.{i}: {tools.refused[name]}; the tool was not registered")
        elif name not in known:
            errors.append(f"agent.tools.{i}: unknown tool {name!r} (registered: {', '.join(known) or 'none'}; register one "
                          "with @register_tool, or serve it from agent.mcp_servers)")
    names = [s.name for s in agent.mcp_servers]
    if len(set(names)) != len(names):
        errors.append(f"agent.mcp_servers: two servers named alike ({names})")
    if not agent.tools and not agent.mcp_servers:
        errors.append("agent: no tools; give agent.tools or agent.mcp_servers")
    return errors

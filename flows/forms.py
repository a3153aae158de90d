"""The Prefect UI's Run form of a deployed recipe: its own model, data, rollout and algorithm.

`Recipe`'s varying sections are discriminated unions over the registries (every family, prompt
source, policy, engine and algorithm), which the UI renders as raw JSON editors or as tabs with the
first variant preselected: a qwen3 recipe's Model tab would show FLUX.2's fields. A deployment's
form is for its own recipe, so each deployment's entrypoint names the variants of its recipe as a
module of this package:

    unirl.flows.forms.algorithm_is_grpo__data_is_arithmetic__model_is_qwen3__...:rl_train

Such a module is made on import (a finder on `sys.meta_path`, installed with this module); its
`rl_train` (or `sft`) is the base flow (`rl-train`, the same function, hooks and options) whose
`recipe` parameter keeps `Recipe`'s validation but shows the JSON schema narrowed to those
variants: each union becomes its variant's fields, with their descriptions, and a typo inside one
is refused by the server's schema check naming the field ("Additional properties are not allowed
('lrr' was unexpected)"). A union inside a list (a composed recipe's `compose.parts[].model`) has
one schema for every item, so it is narrowed to the variants its items use
(`compose_parts_model_is_qwen3_or_sd3`), and each part picks its own there. The function keeps its name, so `prefect deploy --name rl-train/tiny`
finds the deployment. `python -m unirl.flows.deploy write` writes these entrypoints.
"""
from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from typing import TYPE_CHECKING, Annotated, Any

from prefect import Flow
from pydantic import PlainValidator, WithJsonSchema

from unirl.flows.sft import sft
from unirl.stages.recipe import Recipe

SEP, IS, OR = "__", "_is_", "_or_"


def _as_recipe(value: Any) -> Recipe:
    return value if isinstance(value, Recipe) else Recipe.model_validate(value)


# The `recipe` parameter of the flows a run starts inside itself (each shape's iteration flow, the
# async producer) and of `evaluate`, which no deployment names as its entrypoint: validated as
# `Recipe`, shown as an object. Prefect builds a flow's parameter schema when the flow is defined,
# in every `unirl` process; with `Recipe` as the annotation that walked the whole recipe model
# (about 0.2 CPU-s a flow) for a schema nothing reads.
if TYPE_CHECKING:
    InnerRecipe = Recipe
else:
    InnerRecipe = Annotated[Any, PlainValidator(_as_recipe), WithJsonSchema({
        "type": "object", "title": "Recipe", "description": "The run's recipe (the rl-train flow's form shows its fields)."})]


@functools.cache
def recipe_schema() -> dict[str, Any]:
    return Recipe.model_json_schema()


@functools.cache
def unions() -> dict[str, tuple[str, frozenset[str]]]:
    """Every discriminated union in `Recipe`, unions inside union variants and list items included
    (`rollout.engine`, `compose.parts.model`): dotted path -> (discriminator, its variants' tags)."""
    schema = recipe_schema()
    defs = schema["$defs"]
    out: dict[str, tuple[str, frozenset[str]]] = {}

    def walk(node: dict[str, Any], path: str, seen: tuple[str, ...]) -> None:
        ref = node.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[-1]
            if name not in seen:
                walk(defs[name], path, (*seen, name))
            return
        if "discriminator" in node and "oneOf" in node:
            tags = frozenset(node["discriminator"]["mapping"]) | out.get(path, ("", frozenset()))[1]
            out[path] = (node["discriminator"]["propertyName"], tags)
        for branch in node.get("oneOf", []) + node.get("anyOf", []) + node.get("allOf", []):
            walk(branch, path, seen)
        if isinstance(node.get("items"), dict):
            walk(node["items"], path, seen)
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key, seen)

    walk(schema, "", ())
    joined = sorted(tag for _, tags in out.values() for tag in tags if OR in tag)
    if joined:  # a module name joins a list's variants with it
        raise RuntimeError(f"variant names contain {OR!r}, which form module names join variants with: {joined}")
    return out


@functools.cache
def by_name() -> dict[str, str]:
    """Each union's path as a form module's name spells it ('.' reads '_') -> its dotted path."""
    names = {p.replace(".", "_"): p for p in unions()}
    if len(names) != len(unions()):  # two paths would read the same in a module name
        raise RuntimeError(f"union paths collide once '.' reads '_': {sorted(unions())}")
    return names


def variants(recipe: Recipe) -> dict[str, tuple[str, ...]]:
    """The recipe's variants at every union it has (path -> tags), e.g. {"model": ("qwen3",), ...};
    a union inside a list, the variants its items use. A composed recipe's own model, rollout and
    algorithm stay unset (its parts carry them): the sections it does not give are left out, and
    with them off its form."""
    data = recipe.model_dump(mode="json")
    given = recipe.model_fields_set if recipe.shape != "single" else set(Recipe.model_fields)
    out: dict[str, tuple[str, ...]] = {}
    for path, (key, _) in unions().items():
        if path.split(".")[0] not in given:
            continue
        nodes: list[Any] = [data]
        for part in path.split("."):
            nodes = [n.get(part) for n in nodes if isinstance(n, dict)]
            nodes = [item for n in nodes for item in (n if isinstance(n, list) else [n])]
        tags = sorted({n[key] for n in nodes if isinstance(n, dict) and isinstance(n.get(key), str)})
        if tags:
            out[path] = tuple(tags)
    return out


def form_module(recipe: Recipe) -> str:
    """The module of this package whose flows show `recipe`'s form (its variants, in path order)."""
    return __name__ + "." + SEP.join(f"{path.replace('.', '_')}{IS}{OR.join(tags)}" for path, tags in sorted(variants(recipe).items()))


def entrypoint(base: str, recipe: Recipe) -> str:
    """The deployment entrypoint of flow function `base` (`rl_train`, `sft`) with `recipe`'s form."""
    return f"{form_module(recipe)}:{base}"


def parse_variants(module: str) -> dict[str, tuple[str, ...]]:
    """The variants a form module's name gives; ValueError naming what is wrong."""
    name = module.removeprefix(__name__ + ".")
    paths = by_name()
    chosen: dict[str, tuple[str, ...]] = {}
    for item in name.split(SEP):
        under, sep, tags = item.partition(IS)
        if not sep or under not in paths:
            raise ValueError(f"{module}: {item!r} is not <section>{IS}<variant> for a section that varies "
                             f"({', '.join(sorted(paths))})")
        known = unions()[paths[under]][1]
        for tag in tags.split(OR):
            if tag not in known:
                raise ValueError(f"{module}: {paths[under]}: no variant {tag!r} (known: {', '.join(sorted(known))})")
        chosen[paths[under]] = tuple(tags.split(OR))
    return chosen


def narrowed_schema(chosen: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """`Recipe`'s JSON schema with every union in `chosen` (checked by `parse_variants`) replaced
    by its variant's fields (a list item's union: by its chosen variants), and every reference
    inlined (the schema is embedded in the flow's parameter schema, whose own definitions it
    cannot add to)."""
    schema = recipe_schema()
    defs = schema["$defs"]
    # Fields of one policy only: not on another's form (a flow model's responses are never overlong).
    hidden = {"reward.overlong"} if chosen.get("rollout") == ("flow",) else set()

    def build(node: dict[str, Any], path: str, stack: tuple[str, ...]) -> dict[str, Any]:
        node = dict(node)
        ref = node.pop("$ref", None)
        if ref is not None:
            name = ref.rsplit("/", 1)[-1]
            if name in stack:
                raise RuntimeError(f"recursive schema at {path or 'recipe'}: {' -> '.join((*stack, name))}")
            return build({**copy.deepcopy(defs[name]), **node}, path, (*stack, name))
        if "discriminator" in node and "oneOf" in node:
            mapping = node["discriminator"]["mapping"]
            tags = chosen.get(path)
            if tags is not None and len(tags) == 1:
                node.pop("oneOf")
                node.pop("discriminator")
                return build({**node, "$ref": mapping[tags[0]]}, path, stack)
            if tags is not None:  # a list's items: the variants they use (each variant's `kind` tells them apart)
                node.pop("discriminator")
                node["oneOf"] = [{"$ref": mapping[tag]} for tag in tags]
        for key in ("oneOf", "anyOf", "allOf"):
            if key in node:
                # An optional section's choice reads as the section (`Sft` or None), not its class (`SFTConfig`).
                node[key] = [build({"title": node["title"], **b} if "$ref" in b and "title" in node else b, path, stack)
                             for b in node[key]]
        if "properties" in node:
            props = {k: (f"{path}.{k}" if path else k, v) for k, v in node["properties"].items()}
            # A section is titled by its field as every plain field is (`Reward`, `Tiny`), not by its
            # class (`RewardConfig`, `TinyQwen3`).
            node["properties"] = {k: build({"title": k.replace("_", " ").title(), **v}, sub, stack)
                                  for k, (sub, v) in props.items() if not unset(sub) and sub not in hidden}
        if isinstance(node.get("items"), dict):
            node["items"] = build(node["items"], path, stack)
        if isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = build(node["additionalProperties"], path, stack)
        return node

    def unset(path: str) -> bool:
        """A section whose fields vary by variant that the recipe leaves empty (a prompt enhancer's
        `pe` in a single model's recipe): not on the form; a recipe of that shape is its own deployment."""
        inside = [p for p in unions() if p == path or p.startswith(path + ".")]
        return bool(inside) and not any(p in chosen for p in inside)

    return build({k: v for k, v in schema.items() if k != "$defs"}, "", ())


def base_flows() -> dict[str, Any]:
    from unirl.flows.rl import rl_train  # start-up time: it loads torch

    return {"rl_train": rl_train, "sft": sft}


@functools.cache
def form_flow(base_name: str, module: str) -> Any:
    """Flow `base_name` of form module `module`: the base flow's function and options, its `recipe`
    parameter shown with the narrowed schema (validated as `Recipe` all the same)."""
    bases = base_flows()
    if base_name not in bases:
        raise AttributeError(f"module {module!r} has no flow {base_name!r} (its flows: {', '.join(bases)})")
    base = bases[base_name]
    schema = narrowed_schema(parse_variants(module))
    schema["title"] = "Recipe"

    @functools.wraps(base.fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return base.fn(*args, **kwargs)

    signature = inspect.signature(base.fn, eval_str=True)
    params = [p.replace(annotation=Annotated[Recipe, WithJsonSchema(schema)]) if p.name == "recipe" else p
              for p in signature.parameters.values()]
    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": signature.return_annotation}
    run.__module__ = module
    return Flow(run, name=base.name, flow_run_name=base.flow_run_name, description=base.description,
                on_cancellation=base.on_cancellation_hooks, on_crashed=base.on_crashed_hooks,
                validate_parameters=base.should_validate_parameters)


# This module is a package of generated modules, one per set of variants.
__path__: list[str] = []


class FormModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `unirl.flows.forms.<variants>` on import: a module whose attributes are the base flows
    with that form. A name that is not a set of variants is an ImportError saying why."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.rpartition(".")[0] != __name__:
            return None
        try:
            parse_variants(fullname)
        except ValueError as exc:
            raise ImportError(str(exc), name=fullname) from None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__

        def flows(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return form_flow(attr, name)

        module.__getattr__ = flows  # type: ignore[method-assign]


if not any(isinstance(f, FormModules) for f in sys.meta_path):
    sys.meta_path.append(FormModules())

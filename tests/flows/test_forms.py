"""A deployment's Run form (flows/forms.py): the recipe's own variants with their descriptions,
typos refused naming the field by the same schema check the Prefect server runs, the same flow
behind it, and the `overrides` parameter applied as the CLI applies it."""
from __future__ import annotations

import importlib
from typing import Any

import pytest
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate

from tests.conftest import REPO
from unirl.flows import forms
from unirl.flows.rl import rl_train
from unirl.stages.recipe import RecipeError, load_recipe, with_overrides

TINY = REPO / "recipes" / "ar" / "tiny.yaml"
SD3 = REPO / "recipes" / "diffusion" / "quickstart.yaml"


def form_schema(path, base: str = "rl_train") -> tuple[str, dict]:
    point = forms.entrypoint(base, load_recipe(path))
    return point, parameter_schema(load_flow_from_entrypoint(point, use_placeholder_flow=False)).model_dump()


def test_the_form_shows_the_recipes_own_model_with_descriptions() -> None:
    name, schema = form_schema(TINY)
    assert name.startswith("unirl.flows.forms.") and name.endswith(":rl_train") and "model_is_qwen3" in name
    recipe = schema["properties"]["recipe"]
    model = recipe["properties"]["model"]
    assert "oneOf" not in model and "discriminator" not in model
    assert model["properties"]["kind"]["const"] == "qwen3"
    assert model["properties"]["tiny"]["properties"]["hidden_size"]["description"]
    assert "sampler" not in recipe["properties"]["rollout"]["properties"]  # a flow policy's field
    assert recipe["properties"]["rollout"]["properties"]["max_new_tokens"]["description"]
    assert "compose" not in recipe["properties"]  # another shape's section

    # Sections are titled by their field, as plain fields are, not by their classes' names.
    assert [recipe["properties"][k]["title"] for k in ("reward", "train")] == ["Reward", "Train"]
    assert model["properties"]["tiny"]["title"] == "Tiny"
    assert recipe["properties"]["rollout"]["properties"]["max_new_tokens"]["title"] == "Max New Tokens"
    assert [b.get("title") for b in recipe["properties"]["sft"]["anyOf"] if b.get("type") != "null"] == ["Sft"]
    assert "overlong" in recipe["properties"]["reward"]["properties"]  # what truncated responses get

    _, sd3 = form_schema(SD3)
    model = sd3["properties"]["recipe"]["properties"]["model"]
    assert model["properties"]["kind"]["const"] == "sd3"
    assert "sampler" in sd3["properties"]["recipe"]["properties"]["rollout"]["properties"]
    assert "overlong" not in sd3["properties"]["recipe"]["properties"]["reward"]["properties"]  # a flow model's never are


def test_a_typo_inside_a_section_is_refused_naming_the_field() -> None:
    """The check `enforce_parameter_schema` makes on the server, on the generated deployment parameters."""
    _, schema = form_schema(TINY)
    recipe = load_recipe(TINY).model_dump(mode="json", exclude_unset=True)
    validate({"recipe": recipe}, schema, raise_on_error=True)  # the shipped recipe passes
    recipe["model"]["tiny"]["hiden_size"] = 32
    with pytest.raises(ValidationError, match=r"recipe\.model\.tiny.*'hiden_size' was unexpected"):
        validate({"recipe": recipe}, schema, raise_on_error=True)
    recipe = load_recipe(TINY).model_dump(mode="json", exclude_unset=True)
    recipe["model"]["kind"] = "flux2_klein"  # another deployment's model
    with pytest.raises(ValidationError, match=r"recipe\.model\.kind.*'qwen3' was expected"):
        validate({"recipe": recipe}, schema, raise_on_error=True)


def test_the_form_is_the_same_flow_and_prefect_deploy_finds_it_by_flow_name() -> None:
    from prefect.cli.deploy._config import _filter_matching_deploy_config

    name, _ = form_schema(TINY)
    flow: Any = load_flow_from_entrypoint(name, use_placeholder_flow=False)
    assert flow.name == rl_train.name == "rl-train"
    assert flow.flow_run_name == rl_train.flow_run_name
    assert flow.on_cancellation_hooks == rl_train.on_cancellation_hooks
    assert flow.fn.__wrapped__ is rl_train.fn
    assert load_flow_from_entrypoint(name, use_placeholder_flow=False) is flow  # built once
    # `prefect deploy --name rl-train/tiny` matches a prefect.yaml entry by its entrypoint's function
    assert _filter_matching_deploy_config("rl-train/tiny", [{"name": "tiny", "entrypoint": name}])


def test_a_bad_form_module_says_what_is_wrong() -> None:
    with pytest.raises(ImportError, match="'nothing' is not <section>_is_<variant>"):
        importlib.import_module("unirl.flows.forms.nothing")
    with pytest.raises(ImportError, match="model: no variant 'gpt9'"):
        importlib.import_module("unirl.flows.forms.model_is_gpt9")
    with pytest.raises(Exception, match="Flow function with name 'train' not found"):
        load_flow_from_entrypoint("unirl.flows.forms.model_is_qwen3:train", use_placeholder_flow=False)


def test_overrides_apply_as_the_cli_applies_them() -> None:
    recipe = load_recipe(TINY)
    changed = with_overrides(recipe, ["train.lr=3e-4", "reward.scorers=[{name: integer_format}]"])
    assert changed == load_recipe(TINY, ["train.lr=3e-4", "reward.scorers=[{name: integer_format}]"])
    assert changed.train.lr == 3e-4 and recipe.train.lr == 3e-3
    with pytest.raises(RecipeError, match=r"train\.lrr: unknown field; did you mean 'lr'"):
        with_overrides(recipe, ["train.lrr=1"])
    with pytest.raises(RecipeError, match="expected key.sub=value"):
        with_overrides(recipe, ["lr"])


def test_a_composed_recipe_shows_its_parts_not_the_unset_sections() -> None:
    path = REPO / "recipes" / "pe" / "quickstart.yaml"
    _, schema = form_schema(path)
    recipe = schema["properties"]["recipe"]["properties"]
    assert "model" not in recipe and "rollout" not in recipe  # its parts carry them
    compose = next(b for b in recipe["compose"]["anyOf"] if b.get("type") == "object")
    assert compose["properties"]["kind"]["const"] == "pipeline"  # not the unified shape's fields
    part = compose["properties"]["parts"]["items"]
    kinds = sorted(v["properties"]["kind"]["const"] for v in part["properties"]["model"]["oneOf"])
    assert kinds == ["qwen3", "sd3"]  # every part picks among the recipe's own families, not all of them
    assert part["properties"]["model"]["oneOf"][1]["properties"]["tiny"]["properties"]["image_size"]["description"]
    data = load_recipe(path).model_dump(mode="json", exclude_unset=True)
    validate({"recipe": data}, schema, raise_on_error=True)  # the shipped recipe passes
    data["compose"]["parts"][1]["model"]["tiny"]["image_sise"] = 16
    # refused, naming the part's model (among several variants, jsonschema reports the first one's mismatch)
    with pytest.raises(ValidationError, match=r"recipe\.compose\.parts\[1\]\.model"):
        validate({"recipe": data}, schema, raise_on_error=True)

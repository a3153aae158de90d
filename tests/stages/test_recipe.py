"""Recipe validation: every error names its field path and the allowed values, and the CLI
exits non-zero before any model is loaded."""
from __future__ import annotations

import sys

import pytest

from tests import zygote
from tests.conftest import REPO, TINY
from unirl.stages.recipe import Recipe, RecipeError, build_recipe, load_recipe


def errors_of(overrides: list[str], path=TINY) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.errors


def test_tiny_recipe_loads_with_overrides():
    recipe = load_recipe(TINY, ["train.lr=0.01", "rollout.group_size=2", "reward.scorers.0.weight=2"])
    assert recipe.name == "tiny"
    assert recipe.train.lr == 0.01
    assert recipe.rollout.group_size == 2
    assert recipe.reward.scorers[0].weight == 2.0


def test_unknown_field_lists_allowed_fields():
    errs = errors_of(["train.learning_rate=0.1"])
    assert len(errs) == 1
    assert errs[0].startswith("train.learning_rate: unknown field (allowed: ")
    assert "lr" in errs[0] and "micro_batch_size" in errs[0]


def test_union_member_fields_are_reported_without_the_tag():
    errs = errors_of(["algorithm.clip=0.1"])
    assert errs[0].startswith("algorithm.clip: unknown field (allowed: agg, clip_high, clip_low")


def test_wrong_type_and_out_of_range_values_name_the_field():
    errs = errors_of(["rollout.top_p=abc", "train.lr=-1", "iterations=0"])
    assert any(e.startswith("rollout.top_p:") and "'abc'" in e for e in errs)
    assert any(e.startswith("train.lr:") and "greater than 0" in e for e in errs)
    assert any(e.startswith("iterations:") for e in errs)
    assert len(errs) == 3


def test_literal_and_discriminator_errors_list_allowed_values():
    assert errors_of(["train.backend=mpi"]) == ["train.backend: invalid value 'mpi' (allowed: 'auto', 'gloo' or 'nccl')"]
    (err,) = errors_of(["algorithm.name=ppo"])
    assert err.startswith("algorithm: unknown name 'ppo' (allowed: ")


def test_unknown_scorer_lists_registered_scorers():
    (err,) = errors_of(["reward.scorers=[{name: nope}]"])
    assert err.startswith("reward.scorers.0.name: unknown scorer 'nope' (allowed: ")
    assert "exact_match" in err


def test_bad_override_syntax_and_missing_file(tmp_path):
    assert "expected key.sub=value" in errors_of(["train.lr"])[0]
    assert "no item 5" in errors_of(["reward.scorers.5.weight=1"])[0]
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_fingerprint_ignores_iterations_and_storage_but_not_hyperparameters():
    a = load_recipe(TINY)
    assert a.fingerprint() == load_recipe(TINY, ["iterations=9", "storage.root=s3://b/x"]).fingerprint()
    assert a.fingerprint() != load_recipe(TINY, ["train.lr=0.5"]).fingerprint()


def test_the_fingerprint_is_what_the_recipe_sets_so_a_new_field_at_its_default_leaves_it():
    """Fingerprinted: the fields away from their defaults, with a schema version. A section that
    gains a field (here: the same section written twice, the second with one field more) prunes
    to the same thing at that field's default, and differs once the field is set; a recipe and its
    resolved YAML (what worker nodes and resumes load) have one fingerprint."""
    import yaml
    from pydantic import Field

    from unirl.stages.recipe import non_default
    from unirl.stages.runtime.config_base import Section

    class Before(Section):
        lr: float = Field(1e-3)
        steps: int = Field(10)

    class After(Section):
        lr: float = Field(1e-3)
        steps: int = Field(10)
        warmup: int = Field(0)

    assert non_default(Before(lr=0.5)) == non_default(After(lr=0.5)) == {"lr": 0.5}
    assert non_default(After(lr=0.5, warmup=3)) == {"lr": 0.5, "warmup": 3}
    a = load_recipe(TINY)
    resolved = build_recipe(yaml.safe_load(a.to_yaml()))
    assert a.fingerprint() == resolved.fingerprint()
    assert a.fingerprint() != load_recipe(TINY, ["rollout.group_size=3"]).fingerprint()


def test_a_run_started_under_the_old_fingerprint_resumes_and_is_upgraded(tmp_path):
    """run.json written before the schema version (the hash of every field, defaults included)."""
    from unirl.stages.recipe import FINGERPRINT_SCHEMA
    from unirl.stages.run.record import RunMismatchError, open_run

    recipe = load_recipe(TINY, [f"storage.root={tmp_path}"])
    storage, _ = open_run(recipe, "old")
    info = storage.read_json("run.json")
    info.pop("fingerprint_schema")
    info["recipe_hash"] = recipe.legacy_fingerprint()
    storage.write_json("run.json", info)
    _, info = open_run(recipe, "old")
    assert info["recipe_hash"] == recipe.fingerprint() and info["fingerprint_schema"] == FINGERPRINT_SCHEMA
    info.pop("fingerprint_schema")
    info["recipe_hash"] = recipe.legacy_fingerprint()
    storage.write_json("run.json", info)
    with pytest.raises(RunMismatchError, match="different recipe"):
        open_run(load_recipe(TINY, [f"storage.root={tmp_path}", "train.lr=0.5"]), "old")


def test_recipe_schema_carries_descriptions():
    schema = Recipe.model_json_schema()
    assert {"model", "data", "rollout", "reward", "advantage", "algorithm", "train", "storage", "tracking"} <= set(schema["properties"])
    assert schema["$defs"]["TrainConfig"]["properties"]["lr"]["description"]


def test_cli_validate_exit_codes():
    cmd = [sys.executable, "-m", "unirl.flows.cli", "validate", str(TINY)]
    ok = zygote.run(cmd + ["iterations=2"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "iterations: 2" in ok.stdout
    bad = zygote.run(cmd + ["train.lr=-0.1", "model.bogus=1"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "train.lr: Input should be greater than 0; got -0.1" in bad.stderr
    assert "model.bogus: unknown field (allowed: chat_template, dtype, kind, lora, path, tiny)" in bad.stderr


def test_eval_scorer_params_are_checked_at_validate_time_and_reach_the_evaluation(tmp_path):
    """A held-out scorer that needs params (`keyword`, `remote`) is checked like reward.scorers[]
    before anything runs, not at the first evaluation after SFT."""
    import numpy as np

    from unirl.stages.rewards.base import ScoreBatch, build_scorer

    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, ["eval.scorer=keyword"])
    assert any(e.startswith("eval.scorer_params.keywords: ") for e in caught.value.errors), caught.value.errors
    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, ["eval.scorer=remote", "eval.scorer_params={urll: http://127.0.0.1:1}"])
    assert any(e.startswith("eval.scorer_params.urll: ") for e in caught.value.errors), caught.value.errors
    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, ["eval.scorer_params={keywords: [a]}"])
    assert caught.value.errors[0].startswith("eval.scorer_params: given without eval.scorer")
    recipe = load_recipe(TINY, ["eval.scorer=keyword", "eval.scorer_params={keywords: ['4', '7']}"])
    name, params = recipe.eval_scorer()
    assert (name, params) == ("keyword", {"keywords": ["4", "7"]})
    batch = ScoreBatch(["g/0", "g/1"], ["3+4=", "2+2="], texts=["47", "4"])
    np.testing.assert_allclose(build_scorer(name, **params)(batch).scores, [1.0, 0.5])


def test_unknown_fields_say_which_variant_takes_them_or_what_was_meant():
    """A flow model's `sampler` in a text model's rollout names the variant that takes it; a near
    miss gets a suggestion; an unknown scorer is reported with the structural errors at once."""
    errors = errors_of(["rollout.sampler={num_steps: 3}", "algorithm.clip_range=0.1", "train.lrr=0.1",
                        "reward.scorers=[{name: exact_matc}]"])
    assert any(e.startswith("rollout.sampler: unknown field for rollout.kind 'text'; rollout.kind 'flow' takes it (allowed: ")
               for e in errors), errors
    assert any(e.startswith("algorithm.clip_range: unknown field for algorithm.name 'grpo'; algorithm.name ") and "'flow_grpo'" in e
               for e in errors), errors
    assert any(e.startswith("train.lrr: unknown field; did you mean 'lr'? (allowed: ") for e in errors), errors
    assert any(e.startswith("reward.scorers.0.name: unknown scorer 'exact_matc'; did you mean 'exact_match'?") for e in errors), errors
    assert len(errors) == 4, errors

"""The recipe-field trace (stages/runtime/config_base.py) counts the run's reads, not the checks': a field
only validators or tests read must come out unread (tests/recipe_fields.py)."""
from __future__ import annotations

from pydantic import BaseModel

from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.config_base import FIELDS_READ, Section

FIELD = "EvalConfig.scorer"  # read by the validators (Recipe.scorer_errors) and by Recipe.eval_scorer


def test_reads_by_validators_and_tests_do_not_count_reads_by_run_code_do():
    assert Section.__getattribute__ is not BaseModel.__getattribute__, "tests/conftest.py turns the trace on"
    before = set(FIELDS_READ)
    FIELDS_READ.discard(FIELD)
    try:
        recipe = build_recipe({"eval": {"scorer": "exact_match"}})  # the validators read eval.scorer
        assert FIELD not in FIELDS_READ, "a read inside validation counted"
        recipe.iterations = 2  # re-validation on assignment runs the validators again
        assert recipe.scorer_errors(("text",), "model.kind 'qwen3'") == []  # a check `unirl validate` runs, outside pydantic
        assert recipe.eval.scorer == "exact_match"  # this test's own read
        assert FIELD not in FIELDS_READ, "a read by a test or a check counted"
        assert recipe.eval_scorer()[0] == "exact_match"  # what a run reads to score held-out samples
        assert FIELD in FIELDS_READ, "a read by run code did not count"
    finally:
        FIELDS_READ.update(before)

"""Every recipe field is read by something: a field nothing reads is a lie to the user.

Every process of the test session (this one, each `unirl` run, each worker rank) records the
recipe fields its code reads (stages/config_base.py, on while UNIRL_FIELD_TRACE is set, which
tests/conftest.py does). This file sorts after every test folder, so it runs last and sees what
the whole suite read; run alone or on a subset of the suite it skips, having nothing to judge."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from stages.config_base import FIELDS_READ
from stages.recipe import Recipe, _union_members

# Union tags: the registries dispatch on them (model.kind, data.name, ...) through pydantic's
# discriminator, not through attribute reads.
TAGS = {"kind", "name"}


def section_fields() -> set[str]:
    """"Section.field" of every recipe section reachable from Recipe."""
    seen, out, todo = set(), set(), [Recipe]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            out.add(f"{model.__name__}.{name}")
            for member in _union_members(field.annotation) + [field.annotation]:
                if isinstance(member, type) and issubclass(member, BaseModel):
                    todo.append(member)
    return out


def test_every_recipe_field_is_read_by_something(request):
    whole = request.config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if not whole or request.config.option.keyword or request.config.option.markexpr:
        pytest.skip("only the whole suite reads every field")
    read = set(FIELDS_READ)
    for path in Path(os.environ["UNIRL_FIELD_TRACE"]).glob("*.json"):
        read |= set(json.loads(path.read_text()))
    unread = sorted(f for f in section_fields() - read if f.split(".")[1] not in TAGS)
    assert not unread, f"recipe fields nothing read in the whole suite: {unread}"

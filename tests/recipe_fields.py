"""Every recipe field is used by a run: a field nothing reads is a lie to the user, and so is one
only validators and tests read (the run behaves the same whatever it holds).

Every process of the test session (each pytest worker, each `unirl` run, each worker rank)
records the recipe fields its run code reads (stages/runtime/config_base.py, on while UNIRL_FIELD_TRACE
is set, which tests/conftest.py does): code in flows/, tasks/ and stages/, not under validation
(pydantic's validators, `check(cls, recipe)`, `*_errors`), not tests/ (tests/test_recipe_fields.py
says so). When the whole suite has run, tests/conftest.py's `pytest_sessionfinish` (in the
process that started the session, after every pytest worker has written what it read) fails the
session on a field no run read; run on a subset of the suite it judges nothing."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

# Union tags: the registries dispatch on them (model.kind, data.name, ...) through pydantic's
# discriminator, not through attribute reads.
TAGS = {"kind", "name"}


def section_fields() -> set[str]:
    """"Section.field" of every recipe section reachable from Recipe."""
    from unirl.stages.recipe import Recipe, _union_members
    from unirl.stages.runtime.config_base import field_key

    seen, out = set(), set()
    todo: list[type[BaseModel]] = [Recipe]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            out.add(field_key(model, name))
            for member in _union_members(field.annotation) + [field.annotation]:
                if isinstance(member, type) and issubclass(member, BaseModel):
                    todo.append(member)
    return out


def dump_reads(trace: Path) -> None:
    """Write what this process read so far (a pytest worker, before it exits)."""
    import os

    from unirl.stages.runtime.config_base import FIELDS_READ

    trace.mkdir(parents=True, exist_ok=True)
    (trace / f"pytest-{os.getpid()}.json").write_text(json.dumps(sorted(FIELDS_READ)))


def unread_fields(trace: Path) -> list[str]:
    """Recipe fields no process of the session read."""
    from unirl.stages.runtime.config_base import FIELDS_READ

    read = set(FIELDS_READ)
    for path in trace.glob("*.json"):
        read |= set(json.loads(path.read_text()))
    return sorted(f for f in section_fields() - read if f.split(".")[1] not in TAGS)

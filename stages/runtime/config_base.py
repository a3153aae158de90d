"""The base of every recipe section (unknown fields are errors, assignments are validated), and
the sections that several registries' entries share."""
from __future__ import annotations

import atexit
import importlib
import json
import os
import sys
import types
import typing
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

INT64 = 1 << 63  # an integer field holds a signed 64-bit value (what torch, numpy and Arrow store)


def _numeric(annotation: Any) -> bool:
    """An int or float field (optional or not), not a bool one."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in (int, float) for a in args)
    return annotation in (int, float)


class Section(BaseModel):
    """Every recipe section: unknown fields are errors, assignments are validated, floats are
    finite, a number field takes no `true`/`false` and an integer fits in 64 bits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise PydanticCustomError("number_not_bool", "{field}: expected a number, got {value}",
                                              {"field": name, "value": str(value).lower()})
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _integers_fit_64_bits(cls, value: Any) -> Any:
        if type(value) is int and not -INT64 <= value < INT64:
            raise ValueError("does not fit in a signed 64-bit integer")
        return value


class LoraConfig(Section):
    """LoRA adapters through peft; the reference policy is the adapter disabled."""

    rank: int = Field(8, ge=1, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling alpha (effective scale alpha/r).")
    target_modules: list[str] = Field(default_factory=list, description="Module name suffixes; empty: the model family's default.")


class EMAConfig(Section):
    """Exponential moving average of the trainable weights (published alongside the policy)."""

    decay: float = Field(0.99, gt=0, lt=1, description="EMA decay per optimizer step.")


FIELDS_READ: set[str] = set()  # "Section.field" the run's own code read in this process (when traced)


def field_key(section: type, name: str) -> str:
    """"Owner.field" for a field of `section`: the owner is the class that declares it, so a field a
    base declares once (a flow family's `vae_warmup`) is one field, read by the code all its
    families share."""
    owner = next((c for c in section.__mro__ if name in c.__dict__.get("__annotations__", {})), section)
    return f"{owner.__name__}.{name}"


def _trace_field_reads(directory: str) -> None:
    """Record the recipe fields the run's own code reads (attribute access on a section) and write
    the set to `directory` when the process exits: the test suite sets UNIRL_FIELD_TRACE to find
    fields no run uses. A read counts when the code making it is in flows/, tasks/ or stages/ (not
    tests/, not a library) and does not run under validation: inside pydantic (validators, what
    they call, re-validation on assignment), a registry entry's `check(cls, recipe)` or an
    `*_errors` function, what `unirl validate` runs. A field only checked is as unused as one
    nothing reads. Off (no cost) unless the variable is set."""
    import pydantic  # start-up time: pydantic loads on first use, not when a recipe is read

    read = FIELDS_READ
    plain = BaseModel.__getattribute__

    def folder(module: Any) -> str:
        return os.path.dirname(os.path.realpath(module.__file__)) + os.sep

    run_code = tuple(folder(importlib.import_module(f"unirl.{part}")) for part in ("flows", "stages", "tasks"))
    validation = folder(pydantic)
    kinds: dict[object, str] = {}  # code object -> "run", "validation" or "other"

    def kind(code) -> str:
        if code not in kinds:
            path = os.path.realpath(code.co_filename)
            if (path.startswith(validation) or code.co_name.endswith("_errors")
                    or (code.co_name == "check" and code.co_varnames[:2] == ("cls", "recipe"))):
                kinds[code] = "validation"
            else:
                kinds[code] = "run" if path.startswith(run_code) else "other"
        return kinds[code]

    def by_run_code(frame) -> bool:
        if kind(frame.f_code) != "run":
            return False
        while frame is not None:
            if kind(frame.f_code) == "validation":
                return False
            frame = frame.f_back
        return True

    def traced(self: BaseModel, name: str):
        if not name.startswith("_"):
            fields = type(self).__pydantic_fields__ if hasattr(type(self), "__pydantic_fields__") else {}
            if name in fields:
                key = field_key(type(self), name)
                if key not in read and by_run_code(sys._getframe(1)):
                    read.add(key)
        return plain(self, name)

    Section.__getattribute__ = traced  # type: ignore[method-assign, assignment]

    def dump() -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"), "w") as fh:
            json.dump(sorted(read), fh)

    atexit.register(dump)


def _maybe_trace() -> None:
    if os.environ.get("UNIRL_FIELD_TRACE"):
        _trace_field_reads(os.environ["UNIRL_FIELD_TRACE"])


_maybe_trace()

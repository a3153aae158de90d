"""Tools for agentic runs: plain Python functions registered like scorers, and tools served by MCP
servers over stdio (stages/tools/client.py). Every tool a run uses is called through an MCP
server: the run's Python tools are served by unirl's own (stages/tools/serve.py), in a sandbox
(stages/tools/sandbox.py: no network, no writes outside a scratch folder), so a call has a
timeout, an output cap and an error observation instead of a crash, whatever the tool does.

    @register_tool("lookup")
    def lookup(key: str) -> str:
        '''The value stored under `key`.

        Args:
            key: the key to look up.
        '''

A tool's JSON schema comes from its signature (str, int, float, bool, list[...] parameters) and
its docstring (the first paragraph describes it, `Args:` its parameters); a signature it cannot
describe is refused: the tool is not registered, and a recipe that asks for it fails `unirl
validate` at `agent.tools`, naming the tool and the parameter (the module that registers it still
imports, so the other tools and every other command keep working).
"""
from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl.stages.runtime.registry import tools

JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class ToolSpec:
    """What the policy is told about a tool (the chat template's `tools`), and what serves it."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_function(self) -> dict[str, Any]:
        """The OpenAI / Hermes function form chat templates render."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class PythonTool:
    spec: ToolSpec
    fn: Callable[..., Any]


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation) or (None,)
        if item is None:
            raise ValueError(f"{where}: list needs an item type (list[str], list[int], ...)")
        return {"type": "array", "items": _json_type(item, where)}
    raise ValueError(f"{where}: annotation {annotation!r} has no JSON schema type (use str, int, float, bool or list[...])")


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` lines under `Args:` in a Google-style docstring."""
    out, inside = {}, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside = True
            continue
        if inside:
            m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                inside = False
    return out


def schema_of(name: str, fn: Callable[..., Any]) -> ToolSpec:
    """The tool's spec from its signature and docstring; ValueError naming the tool and the parameter."""
    hints = typing.get_type_hints(fn)
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].strip()
    if not description:
        raise ValueError(f"tool {name!r}: no docstring; its first paragraph is what the policy is told the tool does")
    docs = _arg_docs(doc)
    props, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        where = f"tool {name!r}, parameter {pname!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"{where}: *args / **kwargs cannot be described to the policy; name every parameter")
        if pname not in hints:
            raise ValueError(f"{where}: no type annotation (the schema's type comes from it)")
        props[pname] = {**_json_type(hints[pname], where), **({"description": docs[pname]} if pname in docs else {})}
        if param.default is param.empty:
            required.append(pname)
    return ToolSpec(name, description, {"type": "object", "properties": props, "required": required})




def register_tool(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a Python function as the tool `name`; one whose schema cannot be made is refused
    (recorded in `tools.refused`, not registered)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        try:
            spec = schema_of(name, fn)
        except ValueError as exc:
            tools.refused[name] = str(exc)
            return fn
        tools.register(name)(PythonTool(spec, fn))
        return fn

    return wrap

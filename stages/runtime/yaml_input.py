"""YAML that a person or a client typed, read within bounds: a recipe, an override's value, a
server config. PyYAML's safe loader builds no objects, but it lets a 1 KB document of nested
aliases expand to billions of nodes once anything walks it ("billion laughs"), recurses once per
nesting level (a 3000-level list is a RecursionError), keeps the last of two equal keys without
a word (a second `train:` silently replaces the first) and reports errors over several lines.
`load_yaml` checks the event stream first, iteratively and in linear time (bytes, nesting depth,
the size of the document with every alias expanded, one document), then loads it with duplicate
keys refused, and raises `YamlInputError` with one line naming the source, the line and what is
wrong."""
from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a recipe is a few KB; a shipped one at most ~4 KB
MAX_DEPTH = 64  # nesting of mappings and lists (recipes nest 4-6 deep)
MAX_NODES = 100_000  # scalars and collections with every alias expanded (recipes: a few hundred)

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlInputError(ValueError):
    """Input that is not a bounded, single, duplicate-free YAML document; the message is one line."""


def _one_line(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that gives the same key twice (merge keys `<<` may be
    overridden by the mapping's own keys, as YAML says)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor names it below
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {first.line + 1}); give each key once",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _check_events(text: str, source: str, max_depth: int, max_nodes: int) -> None:
    """Depth, expanded size and document count from the event stream, without building a tree."""
    anchors: dict[str, int] = {}
    stack: list[list[Any]] = [[0, None]]  # [expanded nodes so far, anchor] per open collection
    total = 0  # expanded nodes of the whole document so far (the sum over the stack)
    documents = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise YamlInputError(f"{source}: line {event.start_mark.line + 1}: a second YAML document ('---'); "
                                         "give one document")
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([0, event.anchor])
                if len(stack) - 1 > max_depth:
                    raise YamlInputError(f"{source}: line {event.start_mark.line + 1}: nested more than {max_depth} levels deep")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                size, anchor = stack.pop()
                size += 1
                if anchor is not None:
                    anchors[anchor] = size
                stack[-1][0] += size
                total += 1
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor is not None:
                    anchors[event.anchor] = 1
                stack[-1][0] += 1
                total += 1
            elif isinstance(event, yaml.AliasEvent):
                stack[-1][0] += anchors.get(event.anchor, 1)
                total += anchors.get(event.anchor, 1)
            else:
                continue
            if total > max_nodes:
                mark = event.start_mark
                raise YamlInputError(f"{source}: line {mark.line + 1}: more than {max_nodes} values with its aliases expanded; "
                                     "write the values out or use fewer aliases")
    except yaml.YAMLError as exc:
        raise YamlInputError(f"{source}: not valid YAML: {_one_line(exc)}") from None


def load_yaml(data: str | bytes, source: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              max_nodes: int = MAX_NODES) -> Any:
    """One YAML document from `data` (bytes must be UTF-8), within the bounds; `source` names the
    file or override in the error."""
    size = len(data.encode() if isinstance(data, str) else data)
    if size > max_bytes:
        raise YamlInputError(f"{source}: {size} bytes, more than the {max_bytes} bytes a YAML input may have")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise YamlInputError(f"{source}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); "
                                 "save it as UTF-8") from None
    _check_events(data, source, max_depth, max_nodes)
    try:
        return yaml.load(data, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise YamlInputError(f"{source}: not valid YAML: {_one_line(exc)}") from None

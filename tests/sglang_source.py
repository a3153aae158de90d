"""SGLang's request and response definitions, read from the released package's source without
importing it (its wheel pins its own torch and needs CUDA): the wheel is downloaded without
dependencies through pip into a cache folder once, and its files are parsed with `ast`.

    UNIRL_SGLANG_VERSION   the release checked (default below)
    UNIRL_SGLANG_CACHE     where the wheel is kept (default ~/.cache/unirl/sglang)
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

VERSION = os.environ.get("UNIRL_SGLANG_VERSION", "0.5.23")
CACHE = Path(os.environ.get("UNIRL_SGLANG_CACHE", Path.home() / ".cache" / "unirl" / "sglang"))

SRT_IO = "sglang/srt/managers/io_struct.py"
SRT_HTTP = "sglang/srt/entrypoints/http_server.py"
SRT_TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
SRT_FINISH = "sglang/srt/managers/schedule_batch.py"
SRT_SAMPLING = "sglang/srt/sampling/sampling_params.py"
MM = "sglang/multimodal_gen/runtime/entrypoints/post_training/"
MM_IO, MM_ROLLOUT, MM_WEIGHTS, MM_UTILS = MM + "io_struct.py", MM + "rollout_api.py", MM + "weights_api.py", MM + "utils.py"
MM_HTTP = "sglang/multimodal_gen/runtime/entrypoints/http_server.py"
MM_SDE = "sglang/multimodal_gen/runtime/post_training/flow_rollout_controller.py"


class SourceUnavailable(RuntimeError):
    pass


def wheel() -> Path:
    """The cached wheel of VERSION, downloaded (no dependencies, any platform's wheel: only its
    Python sources are read) when missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--implementation", "cp",
           "--abi", "cp311", "-d", str(CACHE), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if proc.returncode != 0 or not found:
        raise SourceUnavailable(
            f"could not download the sglang {VERSION} wheel to check the client's contract ({' '.join(cmd)} exited "
            f"{proc.returncode}): {proc.stderr.strip()[-800:]}\nThe contract test needs PyPI (or a wheel in {CACHE})")
    return found[0]


@dataclass(frozen=True)
class FieldDef:
    name: str
    annotation: str
    required: bool


def _class_fields(tree: ast.Module) -> dict[str, dict[str, FieldDef]]:
    """Annotated class attributes of every class (bases' fields included, defined in the same file)."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, dict[str, FieldDef]] = {}

    def fields(name: str) -> dict[str, FieldDef]:
        if name in out:
            return out[name]
        node = classes[name]
        got: dict[str, FieldDef] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                got.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                default = stmt.value
                required = default is None or (isinstance(default, ast.Call) and ast.unparse(default.func).endswith("field")
                                               and not any(k.arg in ("default", "default_factory") for k in default.keywords))
                got[stmt.target.id] = FieldDef(stmt.target.id, ast.unparse(stmt.annotation), required)
        out[name] = got
        return got

    for name in classes:
        fields(name)
    return out


def _dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)} if isinstance(node, ast.Dict) else set()


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    request_class: str | None
    response_keys: frozenset[str]


def _routes(tree: ast.Module, prefix: str = "") -> dict[str, Route]:
    """`@app.post("/x")`, `@router.get(...)`, `@app.api_route("/x", methods=[...])` handlers: the
    request class of their body (the `obj: X` / `Annotated[X, Body()]` argument) and the string keys
    of every dict literal in their body (the JSON they answer with)."""
    out: dict[str, Route] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            verb = dec.func.attr
            if verb in ("get", "post", "put", "delete"):
                methods = {verb.upper()}
            elif verb == "api_route":
                methods = {m for k in dec.keywords if k.arg == "methods" for m in ast.literal_eval(k.value)}
            else:
                continue
            request = None
            for node in ast.walk(fn):  # a handler that builds its request from the JSON body
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ReqInput"):
                    request = ast.unparse(node.func)
            for arg in fn.args.args:
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                for token in ann.replace("[", " ").replace("]", " ").replace(",", " ").split():
                    if token.endswith("ReqInput") or token in ("GenerateReqInput", "RolloutRequest"):
                        request = token
            keys: set[str] = set()
            for node in ast.walk(fn):
                keys |= _dict_keys(node)
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
                    sub = node.targets[0].slice
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        keys.add(sub.value)
            path = prefix + str(dec.args[0].value)
            prev = out.get(path)
            out[path] = Route(path, frozenset(methods | (prev.methods if prev else set())), request or (prev.request_class if prev else None),
                              frozenset(keys | (prev.response_keys if prev else set())))
    return out


class SGLangSource:
    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)

    def text(self, name: str) -> str:
        return self.zip.read(name).decode()

    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name))

    @cached_property
    def srt_classes(self) -> dict[str, dict[str, FieldDef]]:
        return _class_fields(self.tree(SRT_IO))

    @cached_property
    def sampling_fields(self) -> dict[str, FieldDef]:
        return _class_fields(self.tree(SRT_SAMPLING))["SamplingParams"]

    @cached_property
    def mm_classes(self) -> dict[str, dict[str, FieldDef]]:
        return _class_fields(self.tree(MM_IO))

    @cached_property
    def srt_routes(self) -> dict[str, Route]:
        return _routes(self.tree(SRT_HTTP))

    @cached_property
    def mm_routes(self) -> dict[str, Route]:
        routes = _routes(self.tree(MM_WEIGHTS))
        routes.update(_routes(self.tree(MM_ROLLOUT), prefix="/rollout"))
        routes.update(_routes(self.tree(MM_HTTP)))
        return routes

    @cached_property
    def generate_keys(self) -> tuple[set[str], set[str]]:
        """(keys of a /generate answer, keys of its meta_info), from the tokenizer manager."""
        tree = self.tree(SRT_TOKENIZER)
        top, meta = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                if node.targets[0].id == "out_dict":
                    top |= _dict_keys(node.value)
                if node.targets[0].id == "meta_info":
                    meta |= _dict_keys(node.value)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
                target = node.targets[0]
                if isinstance(target.value, ast.Name) and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
                    (meta if target.value.id == "meta_info" else top if target.value.id == "out_dict" else set()).add(target.slice.value)
        return top, meta

    @cached_property
    def finish_types(self) -> set[str]:
        """The `type` of every FINISH_* reason's to_json()."""
        out: set[str] = set()
        for node in ast.walk(self.tree(SRT_FINISH)):
            if isinstance(node, ast.ClassDef) and node.name.startswith("FINISH"):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Dict):
                        for k, v in zip(sub.keys, sub.values):
                            if isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant) and isinstance(v.value, str):
                                out.add(v.value)
        return out

    @cached_property
    def tensor_wire(self) -> tuple[set[str], set[str]]:
        """(keys of `_maybe_serialize`'s tensor dict, keys of the safetensors dict it saves)."""
        tree = self.tree(MM_UTILS)
        keys, saved = set(), set()
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                if fn.name == "_maybe_serialize":
                    keys |= _dict_keys(node)
                if fn.name == "tensor_to_bytes" and isinstance(node, ast.Call) and ast.unparse(node.func) == "save":
                    saved |= _dict_keys(node.args[0])
        return keys, saved

    @cached_property
    def sde_types(self) -> set[str]:
        """The rollout_sde_type values the flow rollout controller implements."""
        out: set[str] = set()
        for node in ast.walk(self.tree(MM_SDE)):
            if isinstance(node, ast.Compare) and ast.unparse(node.left) in ("effective_sde_type", "self.sde_type"):
                out |= {c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        return out


def compatible(value: object, annotation: str) -> bool:
    """Whether a JSON value fits a field annotation (coarsely: the kinds its type names allow)."""
    a = annotation.replace("typing.", "")
    if value is None:
        return "Optional" in a or "None" in a
    if isinstance(value, bool):
        return "bool" in a or "Any" in a
    if isinstance(value, int):
        return any(t in a for t in ("int", "float", "Any"))
    if isinstance(value, float):
        return "float" in a or "Any" in a
    if isinstance(value, str):
        return any(t in a for t in ("str", "Literal", "Any"))
    if isinstance(value, list):
        return any(t in a for t in ("List", "list", "Set", "set", "Any", "MultimodalDataInputFormat"))
    if isinstance(value, dict):
        return any(t in a for t in ("Dict", "dict", "Any"))
    return False

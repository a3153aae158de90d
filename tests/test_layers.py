"""The house in layers (docs/architecture.md, "Layers"): an `ast` walk over every module of
stages/, tasks/ and flows/ (imports at module level and inside functions alike; `TYPE_CHECKING`
blocks, which never run, left out) finds no import that points to a layer above its module's, and
no cycle among the folders. A new import that points up, or one that closes a cycle, fails here
naming the file and line."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = {"stages": "unirl.stages", "tasks": "unirl.tasks", "flows": "unirl.flows"}

# Folder (the part of a module's name that says its layer) -> layer, bottom up.
LAYERS: dict[str, int] = {
    "unirl": 0, "unirl.stages": 0, "unirl.stages.runtime": 0,                                   # plumbing
    "unirl.stages.recipe": 1, "unirl.stages.sections": 1, "unirl.stages.distill": 1,            # the recipe schema
    "unirl.stages.kernels": 2,                                                                   # kernels and math
    **{f"unirl.stages.{g}": 3 for g in ("models", "policies", "algorithms", "diffusion", "rewards", "sources", "toys",
                                        "compose", "train", "tools")},                          # models and policies
    **{f"unirl.stages.{g}": 4 for g in ("engines", "engine_server", "workers")},                 # engines and workers
    "unirl.stages.run": 5,                                                                       # the run
    "unirl.tasks": 6,
    "unirl.flows": 7,
}
NAMES = {0: "plumbing", 1: "recipe schema", 2: "kernels", 3: "models and policies", 4: "engines and workers",
         5: "the run", 6: "tasks", 7: "flows"}


def modules() -> dict[str, Path]:
    out = {"unirl": REPO / "src" / "unirl" / "__init__.py"}
    for part, package in PARTS.items():
        for path in (REPO / part).rglob("*.py"):
            rel = list(path.relative_to(REPO / part).with_suffix("").parts)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([package, *rel])] = path
    return out


MODULES = modules()


def folder(module: str) -> str:
    """The folder of `module` that LAYERS names (its longest known prefix)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py LAYERS; add its folder there")


def resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported unirl module, line) of every import that runs, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.extend((m, node.lineno) for a in node.names if (m := resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in MODULES else resolve(base)
                if target:
                    found.append((target, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importing module, imported module, "file:line") of every unirl import."""
    out = []
    for module, path in MODULES.items():
        for target, line in imports(module, path):
            if target != module:
                out.append((module, target, f"{path.relative_to(REPO)}:{line}"))
    return out


def test_every_module_is_in_a_layer():
    for module in MODULES:
        folder(module)


def test_no_import_points_up():
    up = [f"{where}: {m} ({NAMES[LAYERS[folder(m)]]}) imports {t} ({NAMES[LAYERS[folder(t)]]})"
          for m, t, where in edges() if LAYERS[folder(t)] > LAYERS[folder(m)]]
    assert up == [], "imports that point to a layer above:\n" + "\n".join(up)


def test_no_cycle_among_the_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for m, t, at in edges():
        a, b = folder(m), folder(t)
        if a != b:
            graph[a].add(b)
            where.setdefault((a, b), at)
    cycles = [c for c in strongly_connected(sorted(set(map(folder, MODULES))), graph) if len(c) > 1]
    detail = [" -> ".join(sorted(c)) + ": " + ", ".join(where[(a, b)] for a in c for b in c if (a, b) in where)
              for c in cycles]
    assert cycles == [], "import cycles among folders:\n" + "\n".join(detail)


def strongly_connected(nodes: list[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                out.append(component)
    return out


def test_the_walk_sees_function_level_imports_and_cycles():
    """The checks above can fail: an import inside a function is seen, and a two-folder loop is a cycle."""
    src = "def f():\n    from unirl.stages.run.iteration import advantages\n"
    tree_path = REPO / "tests" / "_layers_probe.py"
    tree_path.write_text(src)
    try:
        assert imports("unirl.stages.runtime.probe", tree_path) == [("unirl.stages.run.iteration", 2)]
    finally:
        tree_path.unlink()
    assert [sorted(c) for c in strongly_connected(["a", "b", "c"], {"a": {"b"}, "b": {"a"}}) if len(c) > 1] == [["a", "b"]]


REASONS = ("start-up time", "at call time")


def unexplained(path: Path) -> list[int]:
    """Lines of the imports inside functions of `path` that do not say why they are there: a
    `start-up time` or `at call time` comment on an import of their block (imports one after the
    other), or on the comment lines just above the block."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), str(path))
    out: list[int] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody", "handlers"):
                block: list[ast.stmt] = []
                stmts = getattr(node, field, [])
                for stmt in [*(stmts if isinstance(stmts, list) else []), None]:
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        block.append(stmt)
                        continue
                    if block:
                        said = lines[block[0].lineno - 1: block[-1].end_lineno]
                        above = block[0].lineno - 2
                        while above >= 0 and lines[above].strip().startswith("#"):
                            said.append(lines[above])
                            above -= 1
                        if not any(reason in line for line in said for reason in REASONS):
                            out.extend(b.lineno for b in block)
                    block = []
    return sorted(set(out))


def test_every_import_inside_a_function_says_why_it_is_not_at_the_top():
    """An import stays inside a function only for start-up time (it loads torch, a model library or
    a server's stack that reading a recipe must not load; the `unirl` command's, only for its own
    command) or because its module imports this one while it loads ("at call time"); each says so."""
    missing = [f"{path.relative_to(REPO)}:{line}" for path in MODULES.values() for line in unexplained(path)]
    assert missing == [], "imports inside functions with no reason given:\n" + "\n".join(missing)


def test_an_unexplained_import_inside_a_function_is_found():
    probe = REPO / "tests" / "_layers_reason_probe.py"
    probe.write_text("def f():\n    import json\n\n\ndef g():\n    # start-up time: torch\n    import torch\n    import numpy\n"
                     "    x = 1\n    import os\n")
    try:
        assert unexplained(probe) == [2, 10]
    finally:
        probe.unlink()

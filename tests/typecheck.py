"""mypy over the whole tree, as the package installs it: `python tests/typecheck.py [mypy args]`.

The repository keeps flows/, tasks/ and stages/ at its top and installs them as unirl.flows,
unirl.tasks and unirl.stages (setup.py); mypy cannot map folders to other module names, so it
checks a tree of links laid out as the package (`.typecheck/unirl/flows -> ../../flows`, ...),
with tests/ and benchmarks/ beside it. Settings: pyproject.toml [tool.mypy]; cache: .mypy_cache.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("flows", "tasks", "stages")


def link_tree(root: Path = REPO / ".typecheck") -> Path:
    """`root` with unirl/ (its __init__ and the three parts) and tests/, benchmarks/ as links."""
    links = {Path("unirl/__init__.py"): REPO / "src/unirl/__init__.py",
             **{Path("unirl") / part: REPO / part for part in PARTS},
             Path("tests"): REPO / "tests", Path("benchmarks"): REPO / "benchmarks"}
    for rel, target in links.items():
        link = root / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return root


def run(args: list[str] | None = None) -> subprocess.CompletedProcess:
    root = link_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir",
           str(REPO / ".mypy_cache"), "unirl", "tests", "benchmarks", *(args or [])]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True)


if __name__ == "__main__":
    done = run(sys.argv[1:])
    sys.stdout.write(done.stdout + done.stderr)
    sys.exit(done.returncode)

"""The warm server the suite forks `unirl` commands from (tests/zygote.py) gives what a fresh
interpreter gives: the same output and exit status, the command's folder, environment and argv,
`-9` for a SIGKILL, and a fresh start for what it cannot serve the same."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time

from tests import zygote
from tests.conftest import REPO, TINY


def test_a_forked_command_prints_and_exits_as_a_fresh_one():
    for args in (["iterations=2"], ["train.lr=-0.1", "model.bogus=1"]):
        cmd = [sys.executable, "-m", "unirl.flows.cli", "validate", str(TINY), *args]
        env = {**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING"}
        fresh = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        forked = zygote.server().run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and "train.lr" in fresh.stderr


def test_the_command_gets_its_folder_environment_and_argv(tmp_path):
    out = zygote.server().run([sys.executable, "-m", "tests.test_zygote", "a b", "c"], cwd=REPO,
                              env={"PATH": os.environ["PATH"], "ZYGOTE_PROBE": "42"}, capture_output=True, text=True)
    assert out.returncode == 3, out.stderr
    cwd, probe, argv, path0, env_keys = out.stdout.splitlines()
    assert (cwd, probe, argv, path0) == (str(REPO), "42", "['a b', 'c']", str(REPO))
    assert env_keys == "PATH,ZYGOTE_PROBE"


def test_a_sigkill_reads_as_minus_nine_and_a_timeout_kills():
    proc = zygote.server().popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=REPO,
                                 env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    start = time.monotonic()
    try:
        zygote.server().run([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=REPO, timeout=1,
                            capture_output=True)
    except subprocess.TimeoutExpired:
        assert time.monotonic() - start < 30
    else:
        raise AssertionError("a command past its timeout must raise TimeoutExpired")


def test_what_would_run_differently_starts_fresh():
    cli = [sys.executable, "-m", "unirl.flows.cli", "run", str(TINY)]
    assert zygote.forks(cli, {})
    assert not zygote.forks([*cli, "--verbose"], {})  # MLflow would log at INFO: preloaded at WARNING
    assert not zygote.forks(cli, {"MLFLOW_LOGGING_LEVEL": "DEBUG"})
    assert not zygote.forks([sys.executable, "-m", "unirl.flows.reward_server"], {})
    assert not zygote.forks(["prefect", "server", "start"], {})


def import_time_env_reads(tree: ast.Module) -> list[int]:
    """Lines of a module that read the environment when it is imported: outside function bodies
    (a function's defaults and decorators run at import; its body does not)."""
    lines: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for part in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part)
            return
        if isinstance(node, ast.Lambda):
            return
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")) or (
                isinstance(node, ast.Name) and node.id in ("environ", "getenv")):
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return lines


def test_no_preloaded_unirl_module_reads_the_environment_at_import():
    """The fork server imports every `unirl.stages` module once (tests/zygote.py `preload`): one
    that read a variable at import would give every forked command the server's value of it. (Two
    reads happen at import through calls, which this does not see and the fork server handles:
    the registries' plugins and the recipe-field tracer, tests/zygote.py.)"""
    assert import_time_env_reads(ast.parse("X = float(os.environ.get('A', '1'))\ndef f(y=os.getenv('B')):\n"
                                           "    return os.environ['C']\n")) == [1, 2]
    modules = zygote.stages_modules()
    assert "unirl.stages.runtime.storage" in modules and "unirl.stages.recipe" in modules
    found = []
    for path in sorted((REPO / "stages").rglob("*.py")):
        found += [f"{path.relative_to(REPO)}:{line}" for line in import_time_env_reads(ast.parse(path.read_text()))]
    assert not found, f"read at import (read it where it is used): {found}"


if __name__ == "__main__":  # the probe the argv test runs
    print(os.getcwd(), os.environ.get("ZYGOTE_PROBE"), sys.argv[1:], sys.path[0],
          ",".join(k for k in sorted(os.environ) if not k.startswith("UNIRL_")), sep="\n")  # conftest adds UNIRL_*
    sys.exit(3)

"""Shared fixtures: an isolated environment for real `unirl` / Prefect subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Every process the suite starts records the recipe fields it reads (stages/config_base.py);
# tests/test_recipe_fields.py, which runs last, fails on a field nothing read.
os.environ.setdefault("UNIRL_FIELD_TRACE", tempfile.mkdtemp(prefix="unirl-field-trace-"))
TINY = REPO / "recipes" / "ar" / "tiny.yaml"


def isolated_env(tmp: Path) -> dict[str, str]:
    """Each test gets its own Prefect home (SQLite), no MLflow URI from outside, no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    })
    # Worker ranks take cores / ranks threads, capped by OMP_NUM_THREADS when it is set: the
    # tests leave it unset, as a user on one machine would.
    env.pop("OMP_NUM_THREADS", None)
    return env


@pytest.fixture
def unirl_env(tmp_path: Path) -> dict[str, str]:
    return isolated_env(tmp_path)


def run_unirl(args: list[str], env: dict[str, str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"unirl {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """`tiny_weights(family)`: the family's tiny model of tests/tiny.py, built once per session and
    saved in its checkpoint layout, so tests load it by path like real weights."""
    from stages.models.family import families
    from tests.tiny import TINY

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            fam = families.get(family)
            built[family] = fam.materialize(fam.config.model_validate(TINY[family]["model"]), tmp_path_factory.mktemp(family) / "tiny")
        return built[family]

    return get

"""ruff and mypy over the whole tree (settings in pyproject.toml): both clean."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests import typecheck
from tests.conftest import REPO


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(REPO)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # about a minute of CPU: the unit tier stays under two minutes
def test_mypy_finds_nothing():
    done = typecheck.run()
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr

"""The SGLang client against a real SGLang server, where one runs (a GPU host: launch it as
docs/engines.md says and set UNIRL_SGLANG_URL); the same check is a section of
benchmarks/gpu_check.py. Skipped elsewhere: SGLang needs CUDA."""
from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not os.environ.get("UNIRL_SGLANG_URL"), reason="no SGLang server (UNIRL_SGLANG_URL unset; needs CUDA)")
def test_the_client_against_a_running_sglang_server():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    out = gpu_check.check_sglang_client()
    assert out["tokens"] and all(n > 0 for n in out["tokens"])

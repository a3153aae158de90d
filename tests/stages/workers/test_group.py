"""How many CPU threads each rank of a worker group takes."""
from __future__ import annotations

import os

import pytest

from stages.workers.group import threads_per_rank


def test_ranks_split_the_cores_and_obey_a_user_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == 8 and threads_per_rank(2) == 4 and threads_per_rank(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. two runs sharing the machine
    assert threads_per_rank(1) == 1 and threads_per_rank(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "32")  # never more than the cores
    assert threads_per_rank(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads_per_rank(2) == 4

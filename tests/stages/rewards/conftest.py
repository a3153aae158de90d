"""Tiny random reward models, built once per test session and saved to a tmp directory, so every
scorer loads them by path exactly as it would load real weights."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_reward_models import save_tiny_clip, save_tiny_ocr, save_tiny_qwen2_vl


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def ocr_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_ocr(tmp_path_factory.mktemp("ocr"))


@pytest.fixture(scope="session")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A judge that always answers "7 7 ..."."""
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("judge7"), answer="7")


@pytest.fixture(scope="session")
def mute_judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A judge that always answers "great great ...": no number to parse."""
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("judge_great"), answer="great")

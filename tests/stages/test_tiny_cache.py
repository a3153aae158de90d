"""UNIRL_TINY_CACHE: a tiny model is built once per `model:` section and reused; the reuse is the
same folder a fresh build writes."""
from __future__ import annotations

import hashlib
from pathlib import Path

from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.run.record import cached_tiny, materialize_model


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_section_is_built_once_and_another_section_gets_its_own_build(tmp_path):
    model = build_recipe(TINY["qwen3"]).model
    calls = []

    def build(into: Path) -> Path:
        calls.append(into)
        (into / "sub").mkdir(parents=True)
        (into / "sub" / "w.txt").write_text(str(len(calls)))
        return into / "sub"

    first = cached_tiny(tmp_path, model, build)
    again = cached_tiny(tmp_path, model, build)
    assert first == again and first.name == "sub" and (first / "w.txt").read_text() == "1" and len(calls) == 1
    wider = build_recipe(merged(TINY["qwen3"], {"model": {"tiny": {"hidden_size": 48}}})).model
    other = cached_tiny(tmp_path, wider, build)
    assert other != first and len(calls) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no private build folder is left behind"


def test_the_cached_tiny_model_is_the_fresh_build(tmp_path, monkeypatch):
    recipe = build_recipe(TINY["qwen3"])
    monkeypatch.delenv("UNIRL_TINY_CACHE", raising=False)
    fresh = materialize_model(recipe, tmp_path / "fresh")
    monkeypatch.setenv("UNIRL_TINY_CACHE", str(tmp_path / "cache"))
    cached = materialize_model(recipe, tmp_path / "unused")
    assert cached.is_relative_to(tmp_path / "cache") and not (tmp_path / "unused").exists()
    assert digest(cached) == digest(fresh)

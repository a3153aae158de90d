"""Nightly retraining picks the right run and weights (the rl-train subflow is replaced by a
recorder; the whole loop is covered by tests/e2e)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

import unirl.flows.retrain as retrain_mod
from tests.conftest import TINY
from unirl.flows.retrain import RetrainError, generations, local_weights, plan
from unirl.stages.recipe import load_recipe
from unirl.stages.run.record import open_run
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.train.manifests import write_weights_dir


def make_run(root: str, name: str, *, iterations: int, done: int, weights: tuple[int, ...], model_path: str | None = None) -> RunStorage:
    overrides = [f"storage.root={root}", f"iterations={iterations}"] + ([f"model.path={model_path}"] if model_path else [])
    storage, _ = open_run(load_recipe(TINY, overrides), name)
    for i in range(done):
        storage.mark_success(i, {"iteration": i, "metrics": {}})
    for v in weights:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            (local / "config.json").write_text(f'{{"version": {v}}}')
            (local / "model.safetensors").write_bytes(bytes([v]) * 64)
            write_weights_dir(storage, local, storage.weights_rel(v), {"version": v})
    return storage


def test_no_run_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    recipe = load_recipe(TINY, [f"storage.root={tmp_path}"])
    with pytest.raises(RetrainError, match="train it first"):
        plan(recipe, "tiny")


def test_a_run_without_trained_weights_is_an_error(tmp_path: Path) -> None:
    make_run(str(tmp_path), "tiny", iterations=3, done=1, weights=(0,))
    with pytest.raises(RetrainError, match="no trained weights"):
        plan(load_recipe(TINY, [f"storage.root={tmp_path}"]), "tiny")


def test_next_generation_starts_from_the_latest_weights(tmp_path: Path) -> None:
    source = make_run(str(tmp_path), "tiny", iterations=3, done=3, weights=(0, 2, 3))
    make_run(str(tmp_path), "tiny2", iterations=1, done=1, weights=(1,))  # another lineage
    step = plan(load_recipe(TINY, [f"storage.root={tmp_path}"]), "tiny")
    assert step["action"] == "new" and step["run_name"] == "tiny-r001" and step["generation"] == 1
    assert step["recipe"].model.path == str(source.local_path(source.weights_rel(3)))
    assert step["source"] == source.url("weights/v000003")

    # Generation 1 finished: generation 2 starts from generation 1's weights.
    gen1 = make_run(str(tmp_path), "tiny-r001", iterations=2, done=2, weights=(2,), model_path=step["recipe"].model.path)
    assert [k for k, _ in generations(str(tmp_path), "tiny")] == [0, 1]
    step = plan(load_recipe(TINY, [f"storage.root={tmp_path}"]), "tiny")
    assert step["run_name"] == "tiny-r002"
    assert step["recipe"].model.path == str(gen1.local_path(gen1.weights_rel(2)))


def test_an_unfinished_generation_is_resumed_with_its_own_recipe(tmp_path: Path) -> None:
    make_run(str(tmp_path), "tiny", iterations=1, done=1, weights=(1,))
    make_run(str(tmp_path), "tiny-r001", iterations=4, done=2, weights=(2,), model_path="/weights/of/tiny")
    step = plan(load_recipe(TINY, [f"storage.root={tmp_path}", "iterations=9"]), "tiny")
    assert step["action"] == "resume" and step["run_name"] == "tiny-r001"
    assert step["recipe"].model.path == "/weights/of/tiny" and step["recipe"].iterations == 4


def test_object_storage_weights_are_copied_once_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIRL_CACHE", str(tmp_path / "cache"))
    storage = make_run("memory://retrain-test", "tiny", iterations=1, done=1, weights=(1,))
    first = local_weights(storage, 1)
    assert first.is_relative_to(tmp_path / "cache") and (first / "model.safetensors").read_bytes() == bytes([1]) * 64
    assert local_weights(storage, 1) == first  # same path: a resumed run's recipe still matches
    (first / "model.safetensors").write_bytes(b"corrupt")
    assert (local_weights(storage, 1) / "model.safetensors").read_bytes() == bytes([1]) * 64


def test_retrain_flow_calls_rl_train_with_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = make_run(str(tmp_path), "tiny", iterations=1, done=1, weights=(1,))
    calls: list[tuple[Any, str]] = []

    def rl_train(recipe: Any, run_name: str) -> dict[str, str]:
        calls.append((recipe, run_name))
        return {"run": run_name}

    monkeypatch.setattr(retrain_mod, "rl_train", rl_train)
    monkeypatch.setattr(retrain_mod, "get_run_logger", lambda: __import__("logging").getLogger("test"))
    out = retrain_mod.retrain.fn(load_recipe(TINY, [f"storage.root={tmp_path}"]), "tiny", iterations=2)
    (recipe, run_name), = calls
    assert run_name == "tiny-r001" and recipe.iterations == 2
    assert recipe.model.path == str(source.local_path("weights/v000001"))
    assert out["action"] == "new" and out["run"] == "tiny-r001"

"""Which folder a run lands in, and what starting a finished run does (flows/rl.py, flows/cli.py,
stages/run/record.py): a deployment's flow run named in the Run form keeps that name as its run;
a finished run started again says so and exits non-zero, before Prefect starts, unless it is
extended or resumed explicitly. `unirl ui` finds a storage root's store (flows/ui.py)."""
from __future__ import annotations

import signal
import socket

import pytest

from tests.conftest import TINY
from unirl.flows.rl import chosen_run_name
from unirl.flows.ui import free_port, store_uri
from unirl.stages.recipe import load_recipe
from unirl.stages.run.record import finished_error, mark_finished, open_run


def test_a_run_is_finished_only_once_it_ended_well_and_a_larger_length_extends_it(tmp_path) -> None:
    recipe = load_recipe(TINY, [f"storage.root={tmp_path}", "iterations=3"])
    assert finished_error(recipe, "r") is None  # no such run yet
    storage, _ = open_run(recipe, "r")
    for i in range(3):
        storage.mark_success(i, {"iteration": i, "metrics": {}})
    assert finished_error(recipe, "r") is None  # every iteration committed, but killed before its end: it resumes
    mark_finished(storage, 3)
    error = finished_error(recipe, "r")
    assert error is not None and str(error).startswith(f"run 'r' is finished (3 iterations, {storage.url()}); pass "
                                                       "iterations=M with M > 3 to extend it or pick another run name")
    assert finished_error(recipe.model_copy(update={"iterations": 5}), "r") is None  # extended
    assert finished_error(recipe.model_copy(update={"iterations": 2}), "r") is not None
    assert finished_error(recipe, "other") is None


def test_a_deployments_flow_run_name_is_its_run_unless_run_name_is_given(monkeypatch) -> None:
    # Outside a deployment (`unirl run`): the recipe's name, or the one given.
    assert chosen_run_name("tiny", "") == "tiny" and chosen_run_name("tiny", "mine") == "mine"
    # prefect.runtime reads PREFECT__RUNTIME__<module>__<attr> before its run context.
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "8c1f7a4e-0000-0000-0000-000000000000")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "lr-sweep-3")  # typed in the Run form
    assert chosen_run_name("tiny", "") == "lr-sweep-3"
    assert chosen_run_name("tiny", "given") == "given"
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "tiny/lr-sweep-3")  # after Prefect renamed it (a retry)
    assert chosen_run_name("tiny", "") == "lr-sweep-3"
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "my run!")
    with pytest.raises(ValueError, match=r"the flow run's name \(its Run Name; or set the run_name parameter\): 'my run!' "
                                         "is not a plain run name"):
        chosen_run_name("tiny", "")


def test_unirl_run_of_a_finished_run_fails_at_once_saying_what_to_do(tmp_path, capsys) -> None:
    from unirl.flows.cli import main

    recipe = load_recipe(TINY, [f"storage.root={tmp_path}", "iterations=2"])
    storage, _ = open_run(recipe, "done")
    for i in range(2):
        storage.mark_success(i, {"iteration": i, "metrics": {}})
    mark_finished(storage, 2)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # `unirl run` installs its own
    try:
        code = main(["run", str(TINY), f"storage.root={tmp_path}", "iterations=2", "--run-name", "done"])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: run 'done' is finished (2 iterations, ") and "unirl run --resume" in err
    assert not (tmp_path / "done" / "prefect").exists()  # refused before a Prefect API started


def test_unirl_ui_finds_a_roots_store_and_a_free_port(tmp_path) -> None:
    with pytest.raises(ValueError, match=rf"{tmp_path}: no MLflow store there; pass a storage root"):
        store_uri(str(tmp_path))
    (tmp_path / "mlflow.db").write_bytes(b"")
    assert store_uri(str(tmp_path)) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert store_uri("http://mlflow.internal:5000") == "http://mlflow.internal:5000"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = free_port(port, "127.0.0.1")
        assert other != port and other > 0


def test_runs_of_a_root_share_its_store_and_a_run_with_its_own_keeps_it(tmp_path, monkeypatch) -> None:
    from unirl.stages.run.tracking import tracking_uri
    from unirl.stages.runtime.storage import RunStorage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = load_recipe(TINY, [f"storage.root={tmp_path}"])
    assert tracking_uri(recipe, RunStorage(str(tmp_path), "a")) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking_uri(recipe, RunStorage(str(tmp_path), "b")) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "mlflow.db").write_bytes(b"")  # a run started when each run had its own store
    assert tracking_uri(recipe, RunStorage(str(tmp_path), "old")) == f"sqlite:///{tmp_path / 'old' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri(recipe, RunStorage(str(tmp_path), "a")) == "http://mlflow:5000"

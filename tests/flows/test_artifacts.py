"""The artifacts of a training run, built from iteration summaries (no Prefect server needed:
the artifact functions are replaced by recorders)."""
from __future__ import annotations

from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any

import pytest

import unirl.flows.artifacts as artifacts
from tests.conftest import TINY
from unirl.flows.artifacts import RunArtifacts, artifact_key, iteration_row, mlflow_link, summary_markdown
from unirl.stages.recipe import load_recipe
from unirl.stages.runtime.storage import RunStorage, iter_dir, join


def summary(i: int, reward: float) -> dict[str, Any]:
    return {
        "iteration": i, "policy_version": i + 1,
        "metrics": {"rollout/reward_mean": reward, "rollout/reward_std": 0.5, "advantage/mean": 0.0,
                    "advantage/std": 1.0, "advantage/abs_mean": 0.8, "train/loss": -0.1 * i,
                    "train/approx_kl": 1e-4, "train/clip_frac": 0.25, "train/grad_norm": float("nan"),
                    "time/generate_s": 1.5, "time/train_s": 2.0, "time/iteration_s": 4.0},
    }


def test_keys_are_what_prefect_accepts() -> None:
    assert artifact_key("tiny", "iterations") == "unirl-tiny-iterations"
    assert artifact_key("My_Run.2", "summary") == "unirl-my-run-2-summary"
    assert artifact_key("__", "progress") == "unirl-run-progress"


def test_row_has_every_column_and_no_nan() -> None:
    row = iteration_row(summary(3, 0.75))
    assert row["iteration"] == 3 and row["policy_version"] == 4
    assert row["reward_mean"] == 0.75 and row["clip_frac"] == 0.25 and row["loss"] == pytest.approx(-0.3)
    assert row["grad_norm"] is None  # NaN is not JSON
    assert row["kl"] is None  # no reference model
    assert list(row)[2:] == [c for c, _ in artifacts.COLUMNS]


def fake_tracker(**fields: Any) -> SimpleNamespace:
    """A stand-in for the MLflow tracker (no MLflow store here): its fields, and the real
    Tracker's page and experiment id read through them."""
    from unirl.stages.run.tracking import Tracker

    tracker = SimpleNamespace(**fields)
    tracker.experiment_id = MethodType(Tracker.experiment_id, tracker)
    tracker.page = MethodType(Tracker.page, tracker)
    return tracker


def test_mlflow_link_points_into_a_tracking_server() -> None:
    assert mlflow_link("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert mlflow_link("sqlite:////runs/tiny/mlflow.db", "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"


def test_a_local_mlflow_store_is_shown_as_the_command_that_serves_it(tmp_path) -> None:
    """The console and the artifact give what a person can paste: the exact `unirl ui` command
    (a four-slash absolute sqlite URI kept as it is) and the page it then serves."""
    import subprocess
    import sys

    from unirl.stages.run.tracking import browse

    uri = f"sqlite:///{tmp_path / 'my runs' / 'mlflow.db'}"
    page, command = browse(uri, "1", "abc")
    assert command == f"unirl ui 'sqlite:///{tmp_path}/my runs/mlflow.db'" and uri.startswith("sqlite:////")
    assert page == "http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning"  # model training, not GenAI
    assert browse("https://bob:pw@mlflow.example.com/", "2", "r") == (
        "https://bob:***@mlflow.example.com/#/experiments/2/runs/r?workflowType=machine_learning", None)
    # the command's URI opens the store: MLflow reads it back
    (tmp_path / "my runs").mkdir()
    code = "import sys; from mlflow.tracking import MlflowClient; print(MlflowClient(tracking_uri=sys.argv[1]).create_experiment('e'))"
    made = subprocess.run([sys.executable, "-c", code, __import__("shlex").split(command)[-1]], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and made.stdout.strip(), made.stderr[-2000:]


def test_summary_compares_first_and_last_iteration() -> None:
    recipe = load_recipe(TINY, ["iterations=3"])
    rows = [iteration_row(summary(i, r)) for i, r in enumerate((0.25, 0.5))]
    text = summary_markdown(recipe, "tiny", "/runs/tiny", rows, summary(0, 0.25), summary(1, 0.5),
                            "/runs/tiny/weights/v000002", None, "`sqlite://` run `x`")
    assert "2 of 3 iterations finished" in text
    assert "| `rollout/reward_mean` | 0.25 | 0.5 |" in text
    assert "`/runs/tiny/weights/v000002`" in text and "checkpoint: none" in text


def test_summary_has_held_out_before_and_after() -> None:
    recipe = load_recipe(TINY)
    evals = [{"version": 0, "metrics": {"eval/accuracy": 0.125}}, {"version": 3, "metrics": {"eval/accuracy": 0.5}}]
    text = summary_markdown(recipe, "tiny", "/runs/tiny", [], summary(0, 0.25), summary(2, 0.5), None, None, "-", evals)
    assert "| held-out | v000000 | v000003 |" in text
    assert "| `eval/accuracy` | 0.125 | 0.5 |" in text


def test_run_artifacts_cover_resumed_iterations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def recorder(name: str):
        def record(*args: Any, **kwargs: Any) -> str:
            calls.append((name, {"args": args, **kwargs}))
            return f"id-{name}"
        return record

    for name in ("create_table_artifact", "create_progress_artifact", "update_progress_artifact",
                 "create_link_artifact", "create_markdown_artifact"):
        monkeypatch.setattr(artifacts, name, recorder(name))
    recipe = load_recipe(TINY, ["iterations=4"])
    storage = RunStorage(str(tmp_path), "tiny")
    storage.mark_success(0, summary(0, 0.25))
    storage.write_json(join(storage.weights_rel(2), "manifest.json"), {"files": {}})
    for version, acc in ((2, 0.75), (0, 0.25)):
        storage.write_json(f"eval/v{version:06d}/metrics.json", {"version": version, "metrics": {"eval/accuracy": acc}})
    client = SimpleNamespace(get_run=lambda run_id: SimpleNamespace(info=SimpleNamespace(experiment_id="7")))
    tracker = fake_tracker(uri="http://mlflow:5000", run_id="r1", client=client)

    arts = RunArtifacts(recipe, "tiny", storage, tracker)
    arts.start(first=1)  # iter-000000 finished before this flow run
    arts.iteration(summary(1, 0.5))
    arts.finish()

    kinds = [name for name, _ in calls]
    assert kinds == ["create_progress_artifact", "create_link_artifact", "create_table_artifact",
                     "update_progress_artifact", "create_markdown_artifact"]
    assert calls[0][1]["progress"] == 25.0 and calls[0][1]["key"] == "unirl-tiny-progress"
    assert calls[1][1]["link"] == "http://mlflow:5000/#/experiments/7/runs/r1?workflowType=machine_learning"
    table = calls[2][1]["table"]
    assert [r["iteration"] for r in table] == [0, 1] and table[0]["reward_mean"] == 0.25
    assert calls[3][1]["args"] == ("id-create_progress_artifact", 50.0)
    assert storage.url(storage.weights_rel(2)) in calls[4][1]["markdown"]
    assert f"| {iter_dir(0)} | {iter_dir(1)} |" in calls[4][1]["markdown"]
    assert "| `eval/accuracy` | 0.25 | 0.75 |" in calls[4][1]["markdown"]


def test_a_failing_artifact_never_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no API")

    for name in ("create_table_artifact", "create_progress_artifact", "create_link_artifact", "create_markdown_artifact"):
        monkeypatch.setattr(artifacts, name, boom)
    tracker = fake_tracker(uri="sqlite:///x.db", run_id="r1", client=SimpleNamespace(get_run=boom))
    arts = RunArtifacts(load_recipe(TINY), "tiny", RunStorage(str(tmp_path), "tiny"), tracker)
    arts.start(0)
    arts.iteration(summary(0, 0.0))
    arts.finish()


def test_the_iterations_table_is_republished_at_most_every_table_every_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each version of the table holds every row: one per iteration would grow the API's database
    with the square of the run's length. The first iteration publishes (the UI shows the run at
    once), then at most every TABLE_EVERY_S seconds, and the end always publishes the rest."""
    tables: list[list[int]] = []
    monkeypatch.setattr(artifacts, "create_table_artifact", lambda table, **kw: tables.append([r["iteration"] for r in table]))
    for name in ("create_progress_artifact", "update_progress_artifact", "create_link_artifact", "create_markdown_artifact"):
        monkeypatch.setattr(artifacts, name, lambda *a, **kw: "id")
    clock = [100.0]
    monkeypatch.setattr(artifacts.time, "monotonic", lambda: clock[0])
    tracker = fake_tracker(uri="sqlite:///x.db", run_id="r1",
                              client=SimpleNamespace(get_run=lambda run_id: SimpleNamespace(info=SimpleNamespace(experiment_id="0"))))
    arts = RunArtifacts(load_recipe(TINY, ["iterations=6"]), "tiny", RunStorage(str(tmp_path), "tiny"), tracker)
    arts.start(0)
    for i in range(5):
        arts.iteration(summary(i, 0.1 * i))
        clock[0] += artifacts.TABLE_EVERY_S / 2  # two iterations per period
    assert tables == [[0], [0, 1, 2], [0, 1, 2, 3, 4]]
    arts.publish_table()  # nothing new: no new version
    assert len(tables) == 3
    arts.iteration(summary(5, 0.5))
    arts.finish()
    assert tables[-1] == [0, 1, 2, 3, 4, 5] and len(tables) == 4

"""`unirl audit` (stages/run/audit.py) on a small run's storage written by the run's own stages:
requests from the recipe's prompt stream (`write_requests`), rewards and advantages by `score` and
`advantages`, weights published with their sha256 manifests (`write_weights_dir`); only the
rollouts and the train metrics, which need a model, are written here. Each test tampers with a
copy the way a bug in the run would, and the audit must name the iteration and the group, row or
file. The fault-table tests (tests/e2e/test_faults_*.py) audit real resumed runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from tests.conftest import TINY
from unirl.stages.runtime.storage import RunStorage, iter_dir, join

ITERATIONS = 3
SMALL = [f"iterations={ITERATIONS}", "rollout.prompts_per_iteration=3", "rollout.group_size=2", "checkpoint_every=1"]
# async RL on a dedicated engine: iteration k trains rows of versions k-1 and k (max_staleness 1)
ASYNC = ["rollout.engine.name=engine_server", "rollout.mode=async", "rollout.max_staleness=1", "rollout.correction={}"]
# rollout accumulation: iterations 0, 1 sampled by version 0 and trained in one update at 1 (v000001), 2, 3 by version 1
ACCUMULATE = ["train.accumulate_rollouts=2"]


def build_run(root: Path, overrides: list[str], stale: int = 0, iterations: int = ITERATIONS) -> RunStorage:
    """Run `r` under `root`: `iterations` committed iterations, rows of iteration i sampled with
    version max(0, v - stale), v the version that trains them (i; with train.accumulate_rollouts M,
    i // M, the update at each window's last iteration), and weights v0..vN."""
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.accumulation import accumulated, closes, version_after, version_of, window
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
    from unirl.stages.train.manifests import write_weights_dir

    recipe = load_recipe(str(TINY), [*SMALL, *overrides, f"iterations={iterations}", f"storage.root={root}"])
    storage = RunStorage(str(root), "r")
    storage.write_text("recipe.yaml", recipe.to_yaml())
    storage.write_json("run.json", {"run_id": "test", "run_name": "r", "recipe_hash": recipe.fingerprint(),
                                    "iterations": iterations, "mlflow_run_id": None})

    def publish(version: int) -> None:
        local = root / "export" / f"v{version}"
        local.mkdir(parents=True)
        (local / "model.safetensors").write_bytes(bytes([version]) * 64)
        (local / "config.json").write_text(json.dumps({"version": version}))
        write_weights_dir(storage, local, storage.weights_rel(version), {"version": version})

    publish(0)
    for i in range(iterations):
        requests = storage.commit_stage(i, "requests", it.write_requests(storage, recipe, i))
        table = read_shard(storage, requests["files"][0], "requests")
        trained = version_of(recipe, i)
        rows = [{"sample_id": f"{g}/{j}", "group_id": g, "iteration": i, "policy_version": max(0, trained - stale), "parts": ["text"],
                 "metadata": meta, "prompt": prompt, "prompt_ids": [1, 2], "response_ids": [3], "response_logprobs": [-0.5],
                 "finish_reason": "stop", "text": str(j)}
                for g, prompt, meta in zip(*(table.column(c).to_pylist() for c in ("group_id", "prompt", "metadata")))
                for j in range(recipe.rollout.group_size)]
        rel = join(iter_dir(i), "rollouts", "part-000.arrow")
        write_shard(storage, rel, table_from_rows(rows, "rollouts", ["text"]))
        stage = "produce" if recipe.rollout.mode == "async" else "generate"
        generated = storage.commit_stage(i, stage, {"files": [rel], "rows": len(rows)})
        if stage == "produce":
            storage.commit_stage(i, "generate", generated)
        scored = storage.commit_stage(i, "score", it.score(storage, recipe, i, [rel]))
        storage.commit_stage(i, "advantage", it.advantages(storage, recipe, i, scored["files"]))
        fresh = max(0, trained - stale) == trained  # a row of an older version replays to other log-probs
        result: dict = {"iteration": i, "policy_version": version_after(recipe, i),
                        "metrics": {"behaviour_logp_max_abs_diff": 2e-6 if fresh else 0.3} if closes(recipe, i) else {}}
        if accumulated(recipe) > 1:
            span = window(recipe, i)
            result.update(update=closes(recipe, i), window=[span[0], span[-1]])
        storage.write_json(join(iter_dir(i), "train.json"), result)
        storage.commit_stage(i, "train", {"files": [join(iter_dir(i), "train.json")], **result})
        if closes(recipe, i):
            publish(version_after(recipe, i))
        storage.mark_success(i, {"iteration": i, "metrics": {}})
    return storage


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The untampered runs (sync trainside; async, one version stale; two batches per update, 4
    iterations), built once."""
    made = {}
    for name, overrides, stale, iterations in (("sync", [], 0, ITERATIONS), ("async", ASYNC, 1, ITERATIONS),
                                               ("accumulate", ACCUMULATE, 0, 4)):
        root = tmp_path_factory.mktemp(name)
        build_run(root, overrides, stale, iterations)
        made[name] = root
    return made


@pytest.fixture
def run_copy(runs, tmp_path):
    """`run_copy(kind)`: a fresh copy of an untampered run to tamper with."""
    def copy(kind: str = "sync") -> RunStorage:
        shutil.copytree(runs[kind] / "r", tmp_path / kind / "r")
        return RunStorage(str(tmp_path / kind), "r")

    return copy


def audit(storage: RunStorage):
    from unirl.stages.run.audit import audit_run

    return audit_run(storage)


def rewrite(storage: RunStorage, rel: str, kind: str, change) -> None:
    """Rewrite shard `rel` with its rows changed by `change(rows) -> rows`."""
    from unirl.stages.runtime.sample import read_shard, write_shard

    table = read_shard(storage, rel, kind)
    write_shard(storage, rel, pa.Table.from_pylist(change(table.to_pylist()), schema=table.schema))


def shard_rows(storage: RunStorage, rel: str, kind: str) -> list[dict]:
    from unirl.stages.runtime.sample import read_shard

    return read_shard(storage, rel, kind).to_pylist()


PART, ADV = "rollouts/part-000.arrow", "advantages.arrow"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_untampered_run_passes(run_copy, kind):
    report = audit(run_copy(kind))
    assert report.ok, report.text()
    assert [line.where for line in report.lines] == [iter_dir(i) for i in range(ITERATIONS)]
    assert [(line.groups, line.rows, line.weights) for line in report.lines] == [(3, 6, "ok")] * ITERATIONS
    if kind == "async":  # iteration 1 trains version 0's rows: the behaviour difference is measured, not judged
        assert [line.versions for line in report.lines] == [(0, 0), (0, 0), (1, 1)]
        assert [line.measured_only for line in report.lines] == [False, True, True]
    assert report.weights_checked == ITERATIONS + 1
    assert report.text().endswith("audit passed")


def test_a_group_trained_again_in_a_later_iteration_is_named(run_copy):
    storage = run_copy()
    first = shard_rows(storage, join(iter_dir(0), PART), "rollouts")
    group = first[0]["group_id"]
    mine = [r for r in first if r["group_id"] == group]
    advantages = [r for r in shard_rows(storage, join(iter_dir(0), ADV), "advantages") if r["group_id"] == group]
    rewrite(storage, join(iter_dir(2), PART), "rollouts", lambda rows: rows + mine)
    rewrite(storage, join(iter_dir(2), ADV), "advantages", lambda rows: rows + advantages)
    report = audit(storage)
    assert not report.ok
    assert f"iter-000002: group {group!r} trained again (first in iter-000000)" in report.violations
    assert report.lines[2].problems and not report.lines[0].problems and not report.lines[1].problems


def test_a_row_duplicated_inside_an_iteration_is_named(run_copy):
    storage = run_copy()
    rewrite(storage, join(iter_dir(1), PART), "rollouts", lambda rows: rows + rows[:1])
    sid = shard_rows(storage, join(iter_dir(1), PART), "rollouts")[0]["sample_id"]
    assert any(v.startswith(f"iter-000001: row {sid!r} trained twice") for v in audit(storage).violations)


def test_a_group_that_was_never_requested_is_named(run_copy):
    storage = run_copy()
    rewrite(storage, join(iter_dir(1), PART), "rollouts",
            lambda rows: [{**r, "group_id": "elsewhere/7"} if i < 2 else r for i, r in enumerate(rows)])
    assert "iter-000001: group 'elsewhere/7' trained, but it is not among iter-000001's requests" in audit(storage).violations


def test_a_row_too_stale_for_a_sync_run_is_named(run_copy):
    storage = run_copy()
    rewrite(storage, join(iter_dir(2), PART), "rollouts", lambda rows: [{**rows[0], "policy_version": 1}, *rows[1:]])
    sid = shard_rows(storage, join(iter_dir(2), PART), "rollouts")[0]["sample_id"]
    assert audit(storage).violations == [
        f"iter-000002: row {sid!r} policy_version 1 is 1 older than the iteration (sync rollout with the trained weights)"]


def test_a_row_older_than_max_staleness_is_named(run_copy):
    storage = run_copy("async")
    rewrite(storage, join(iter_dir(2), PART), "rollouts", lambda rows: [{**rows[0], "policy_version": 0}, *rows[1:]])
    sid = shard_rows(storage, join(iter_dir(2), PART), "rollouts")[0]["sample_id"]
    assert audit(storage).violations == [
        f"iter-000002: row {sid!r} policy_version 0 is 2 older than the iteration (max_staleness 1)"]


def test_a_row_the_producer_did_not_sample_is_named(run_copy):
    """Async: the trainer's admitted rows must come from the producer's batch of that iteration."""
    storage = run_copy("async")
    rows = shard_rows(storage, join(iter_dir(1), PART), "rollouts")
    forged = {**rows[0], "sample_id": rows[0]["group_id"] + "/9"}
    admitted = join(iter_dir(1), "rollouts", "admitted.arrow")
    from unirl.stages.runtime.sample import table_from_rows, write_shard

    write_shard(storage, admitted, table_from_rows([*rows, forged], "rollouts", ["text"]))
    storage.write_json(storage.manifest_rel(1, "generate"), {"files": [admitted], "rows": len(rows) + 1})
    rewrite(storage, join(iter_dir(1), ADV), "advantages", lambda adv: adv + [{**adv[0], "sample_id": forged["sample_id"]}])
    assert audit(storage).violations == [
        f"iter-000001: row {forged['sample_id']!r} (iter-000001/rollouts/admitted.arrow) was not sampled by the producer "
        "for iter-000001"]


def test_a_weights_file_modified_after_publishing_is_named(run_copy):
    storage = run_copy()
    path = storage.local_path("weights/v000002/model.safetensors")
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    (storage.local_path("weights/v000003/config.json")).unlink()
    report = audit(storage)
    assert report.violations == ["weights/v000002/model.safetensors: sha256 differs from its manifest",
                                 "weights/v000003/config.json: listed in its manifest, but missing"]
    assert [line.weights for line in report.lines] == ["ok", "BAD", "BAD"]  # iteration 1 published v000002


def test_the_initial_weights_are_checked_too(run_copy):
    storage = run_copy()
    storage.local_path("weights/v000000/model.safetensors").write_bytes(b"other")
    assert audit(storage).violations == ["weights/v000000/model.safetensors: sha256 differs from its manifest"]


def test_a_behaviour_difference_above_the_tolerance_is_named(run_copy):
    storage = run_copy()
    rel = join(iter_dir(1), "train.json")
    trained = storage.read_json(rel)
    trained["metrics"]["behaviour_logp_max_abs_diff"] = 0.5  # the tiny recipe's float32 tolerance: 1e-4
    storage.write_json(rel, trained)
    (violation,) = audit(storage).violations
    assert violation.startswith("iter-000001: the first update's replay differs from the log-probs recorded at sampling by 0.5, "
                                "above the run's tolerance 0.0001")


def test_a_difference_in_the_mask_band_passes_only_with_its_tokens_masked(run_copy):
    """Above the tolerance (1e-4) but within the text policy's mask limit (1e-2) the run masked the
    tokens (docs/extending.md, "The behaviour check"): train.json says so, or the audit names it."""
    storage = run_copy()
    rel = join(iter_dir(1), "train.json")
    trained = storage.read_json(rel)
    trained["metrics"].update(behaviour_logp_max_abs_diff=5e-4, behaviour_masked_frac=0.002)
    storage.write_json(rel, trained)
    assert audit(storage).ok
    trained["metrics"]["behaviour_masked_frac"] = 0.0
    storage.write_json(rel, trained)
    (violation,) = audit(storage).violations
    assert violation == (f"iter-000001: the first update's replay differs from the log-probs recorded at sampling by 0.0005, "
                         f"above the run's tolerance 0.0001, and no token was masked ({rel} behaviour_logp_max_abs_diff)")


def test_an_iteration_still_running_is_not_audited(run_copy):
    storage = run_copy()
    storage.remove(join(iter_dir(2), "_SUCCESS"))
    rewrite(storage, join(iter_dir(2), PART), "rollouts", lambda rows: rows + rows)  # half written, say
    report = audit(storage)
    assert report.ok, report.text()
    assert report.committed == [0, 1] and report.pending == [2]
    assert "iter-000002 not committed yet (not audited)" in report.text()


def test_a_shard_that_does_not_read_back_is_a_violation(run_copy):
    storage = run_copy()
    storage.local_path(join(iter_dir(1), PART)).write_bytes(b"not arrow")
    (violation,) = audit(storage).violations
    assert violation.startswith("iter-000001: cannot be read back: ") and "part-000.arrow: not an Arrow IPC file" in violation


def test_a_pipeline_part_is_audited_as_a_run_of_its_own(runs, tmp_path):
    """A pipeline's parts train in runs of their own (parts/<name>), over the pipeline's committed
    iterations (here two of the part's three)."""
    top = RunStorage(str(tmp_path), "pipe")
    shutil.copytree(runs["sync"] / "r", tmp_path / "pipe" / "parts" / "writer")
    top.write_text("recipe.yaml", (runs["sync"] / "r" / "recipe.yaml").read_text())
    top.write_json("run.json", {"run_id": "test", "run_name": "pipe"})
    for i in range(ITERATIONS - 1):
        top.mark_success(i, {"iteration": i, "metrics": {}})
    part = RunStorage(str(tmp_path / "pipe" / "parts"), "writer")
    rewrite(part, join(iter_dir(1), PART), "rollouts", lambda rows: [{**rows[0], "policy_version": 0}, *rows[1:]])
    sid = shard_rows(part, join(iter_dir(1), PART), "rollouts")[0]["sample_id"]
    report = audit(top)
    assert [line.where for line in report.lines] == ["parts/writer/iter-000000", "parts/writer/iter-000001"]
    assert report.violations == [f"parts/writer/iter-000001: row {sid!r} policy_version 0 is 1 older than the iteration "
                                 "(sync rollout with the trained weights)"]


def test_an_accumulating_run_is_audited_by_its_windows(run_copy):
    """train.accumulate_rollouts 2: each window's rows trained by the version before it, one
    update (and one published version) at its last iteration."""
    report = audit(run_copy("accumulate"))
    assert report.ok, report.text()
    assert [(line.versions, line.weights) for line in report.lines] == [((0, 0), "-"), ((0, 0), "ok"), ((1, 1), "-"),
                                                                      ((1, 1), "ok")]
    assert [line.behaviour for line in report.lines] == [None, 2e-6, None, 2e-6] and report.weights_checked == 3


def test_a_row_newer_than_its_window_is_named(run_copy):
    """Iteration 1 samples with version 0 still: the window's update comes after it."""
    storage = run_copy("accumulate")
    rewrite(storage, join(iter_dir(1), PART), "rollouts", lambda rows: [{**rows[0], "policy_version": 1}, *rows[1:]])
    sid = shard_rows(storage, join(iter_dir(1), PART), "rollouts")[0]["sample_id"]
    assert audit(storage).violations == [f"iter-000001: row {sid!r} policy_version 1 is newer than the iteration (version 0)"]


def test_an_update_in_the_middle_of_a_window_or_on_another_window_is_named(run_copy):
    storage = run_copy("accumulate")
    for i, change in ((2, {"update": True}), (3, {"window": [3, 3]})):
        rel = join(iter_dir(i), "train.json")
        storage.write_json(rel, {**storage.read_json(rel), **change})
    assert audit(storage).violations == [
        "iter-000002: took an update, but the update of iter-000002 .. iter-000003 is its last iteration's",
        "iter-000003: train.json names the window [3, 3], not [2, 3] (train.accumulate_rollouts 2)"]


def test_a_folder_that_is_not_a_run_is_named(tmp_path):
    from unirl.stages.run.audit import NotARunError, resolve

    (tmp_path / "runs" / "nothing").mkdir(parents=True)
    with pytest.raises(NotARunError, match=rf"{tmp_path / 'runs' / 'nothing'}: not a run folder"):
        audit(resolve(str(tmp_path / "runs" / "nothing")))
    with pytest.raises(NotARunError, match="give --root only with a run name"):
        resolve(str(tmp_path / "runs" / "nothing"), root=str(tmp_path))


def test_the_cli_prints_the_table_and_exits_by_the_verdict(run_copy, capsys):
    from unirl.flows.cli import main

    storage = run_copy()
    assert main(["audit", "r", "--root", str(Path(storage.base).parent)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["iteration", "groups", "rows", "versions", "weights", "behaviour", "max", "diff",
                                           "status"]
    assert out.splitlines()[2].split() == ["iter-000000", "3", "6", "0..0", "ok", "2e-06", "ok"]
    storage.local_path("weights/v000001/model.safetensors").write_bytes(b"other")
    assert main(["audit", storage.base]) == 1
    out = capsys.readouterr().out
    assert "FAIL (1)" in out and "weights/v000001/model.safetensors: sha256 differs from its manifest" in out
    assert main(["audit", str(Path(storage.base).parent / "missing")]) == 2
    assert "missing: not a run folder" in capsys.readouterr().err

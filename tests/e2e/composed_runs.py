"""What the prompt-enhancer and unified-model e2e tests share: one uninterrupted reference run,
and the same run killed with SIGKILL while it is stopped in iteration 1's sync, then resumed (and
audited: `unirl audit`, every part's or stage's groups trained once, its weights and behaviour)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests import zygote
from tests.conftest import REPO, run_unirl


def reference_run(tmp: Path, prefect_server: Any, mlflow_uri: str, recipe: dict[str, Any], name: str) -> tuple[Path, Path, Any]:
    """(run folder, recipe file, `unirl run`'s completed process) of an uninterrupted run on the
    session's Prefect server and MLflow."""
    from tests.conftest import isolated_env

    env = {**isolated_env(tmp), **prefect_server.client_env, "MLFLOW_TRACKING_URI": mlflow_uri}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, "storage": {"root": str(tmp / "runs")}}))
    out = run_unirl(["run", str(path), "--run-name", name], env)
    return tmp / "runs" / name, path, out


def killed_and_resumed(recipe: Path, name: str, root: Path, env: dict[str, str], *, workers_at_least: int,
                       stopped: Callable[[Path], None], overrides: tuple[str, ...] = ()) -> tuple[Path, Any]:
    """The run (with `overrides` of the recipe) stopped in iteration 1's sync (`stopped(run)` checks
    what is committed by then), killed with SIGKILL (no worker process may outlive it), then resumed
    to the end: (run folder, the resumed `unirl run`'s completed process)."""
    import psutil

    from tests.e2e.test_rl_flow import STOP_AT_SYNC, wait_stopped
    from unirl.flows.hooks import worker_processes

    args = ["run", str(recipe), "--run-name", name, f"storage.root={root}", *overrides]
    proc = zygote.popen([sys.executable, "-m", "unirl.flows.cli", *args], env={**env, "UNIRL_FAULTS": STOP_AT_SYNC},
                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = root / name
    wait_stopped(proc)
    stopped(run)
    workers = worker_processes(lambda url: str(run) in url)
    assert len(workers) >= workers_at_least, f"expected {workers_at_least} worker processes of the run, found {len(workers)}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "worker processes outlived the run"
    out = run_unirl(args, env)
    assert "iter-000000 (" not in out.stdout and "iter-000002 (3/3)" in out.stdout
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    report = audit_run(RunStorage(str(root), name))
    assert report.ok and len(report.lines) >= 3, report.text()
    return run, out


def composed_rollouts(run: Path, rows: int, parts: tuple[str, ...]) -> Any:
    """The last iteration's composed rollout shard, opened with plain pyarrow: `rows` rows, each
    holding every part's sample under its name (prompt -> plan or rewrite -> ... -> the image that
    drew the last text), each part's prompt the text of the one before it."""
    import pyarrow.ipc as ipc

    composed = ipc.open_file(str(run / "iter-000002" / "rollouts" / "composed.arrow")).read_all()
    assert composed.num_rows == rows
    row = composed.slice(0, 1).to_pylist()[0]
    assert row["parts"] == list(parts) and row[f"{parts[-1]}/media_png"][:4] == b"\x89PNG"
    for before, after in zip(parts, parts[1:]):
        assert row[f"{after}/prompt"] == row[f"{before}/text"].strip() and row[f"{after}/group_id"] == row[f"{before}/sample_id"]
    return composed

"""State hooks of the `rl-train` flow: a cancelled or crashed run leaves no worker group behind.

How a worker group normally ends when its flow run is cancelled from Prefect: the worker sends
SIGTERM to the flow-run process, `rl_train`'s `finally` closes the group (shutdown command, then
SIGKILL to its process group), and if the flow-run process is killed first, PR_SET_PDEATHSIG takes
the torchrun agent and then every rank down with it. These hooks are the last line: Prefect runs
them after the flow-run process is gone (in another process), so they find the run's torchrun
processes by their `--spec` file and kill them. Nothing is lost: every committed stage is kept,
and the run resumes with the same run name.
"""
from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers.group import close_group
from unirl.tasks.common import close_engine, stop_producer


def _spec_url(spec: dict[str, Any], cwd: str | None) -> str | None:
    """The run folder URL a worker spec points at; a relative local root is relative to the
    worker's working directory."""
    root = spec.get("root")
    run = spec.get("run")
    if not root or not run:
        return None
    if "://" not in root and not os.path.isabs(root) and cwd:
        root = os.path.join(cwd, root)
    try:
        return RunStorage(root, run, spec.get("options") or {}).url()
    except Exception:  # noqa: BLE001 - an unreadable spec is not ours to judge
        return None


def worker_processes(match: Callable[[str], bool]) -> list[Any]:
    """Live `torchrun ... -m unirl.stages.workers --spec FILE` processes (agent and ranks) on this host
    whose run folder URL satisfies `match`."""
    import psutil  # start-up time: psutil loads on first use, not when a recipe is read

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "unirl.stages.workers" not in cmd or "--spec" not in cmd:
            continue
        try:
            spec = json.loads(Path(cmd[cmd.index("--spec") + 1]).read_text())
            cwd = proc.cwd()
        except (IndexError, OSError, ValueError, psutil.Error):
            continue
        url = _spec_url(spec, cwd)
        if url is not None and match(url):
            found.append(proc)
    return found


def stop_workers(storage_url: str) -> int:
    """Stop the run's worker group: the in-process one, then any left on this host. Returns
    how many stray processes were killed."""
    stop_producer(storage_url)
    close_engine(storage_url)
    close_group(storage_url)
    return stop_matching_workers(lambda url: url == storage_url)


def stop_matching_workers(match: Callable[[str], bool]) -> int:
    """SIGKILL every worker process on this host whose run folder URL satisfies `match`, with
    its torchrun agent's whole process group. Returns how many processes were found."""
    import psutil  # start-up time: psutil loads on first use, not when a recipe is read

    procs = worker_processes(match)
    for proc in procs:
        try:
            if os.getpgid(proc.pid) == proc.pid:  # the torchrun agent leads the group's session
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def run_storage_url(parameters: dict[str, Any]) -> str:
    """The run folder of an `rl-train` flow run, from its parameters."""
    recipe = Recipe.model_validate(parameters["recipe"])
    run_name = parameters.get("run_name") or recipe.name
    return RunStorage(recipe.storage.root, run_name, recipe.storage.options).url()


def stop_worker_group(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook of `rl-train`."""
    from prefect.logging.loggers import flow_run_logger  # start-up time: prefect loads on first use, not when a recipe is read

    log = flow_run_logger(flow_run, flow)
    try:
        url = run_storage_url(dict(flow_run.parameters))
    except Exception as exc:  # noqa: BLE001 - a hook must not raise; say why it did nothing
        log.warning("cannot tell the run folder of flow run %s: %s", flow_run.name, exc)
        return
    killed = stop_workers(url)
    log.info("%s: worker group of %s stopped%s", state.name, url,
             f" ({killed} stray process(es) killed)" if killed else "")

"""What the tasks share: the run's storage, the process-wide worker group of a run, and how the
other nodes of a multi-node group start (`node_launcher`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from prefect import get_run_logger, tags
from prefect.settings import get_current_settings

from unirl.stages.engines import RolloutEngine, in_group
from unirl.stages.engines.agentic import agentic
from unirl.stages.recipe import Recipe
from unirl.stages.run import iteration as it
from unirl.stages.run.producer_process import ProducerProcess
from unirl.stages.runtime.registry import engines
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers.group import ModelGroup, NodeLauncher, WorkerGroup, get_group
from unirl.stages.workers.rendezvous import GroupPlan, NodeSetupError
from unirl.tasks.console import say

T = TypeVar("T")
_UNTAGGED: dict[int, tuple[Any, Any]] = {}
_ENGINES: dict[str, RolloutEngine] = {}


def on_server() -> bool:
    """True when runs report to a Prefect server (a deployment, or `PREFECT_API_URL` set); False
    under the local API of `unirl run` (flows/ephemeral.py, which names it in UNIRL_LOCAL_PREFECT_API)."""
    url = get_current_settings().api.url
    return url is not None and url != os.environ.get("UNIRL_LOCAL_PREFECT_API")


def staged(task: T) -> T:
    """Pays a little at the quickstart geometry: 37 against 66 ms of fixed orchestration per AR
    quickstart iteration (benchmarks/README.md, "Untagged tasks on the ephemeral API").

    The task as a flow calls it. On a server it keeps its tags (`gpu` takes a slot of the global
    concurrency limit `tag:gpu`, docs/deploy.md). On the ephemeral API no limit can be set and the UI
    is gone when the run ends, yet every tagged task run asks the API for concurrency slots before it
    starts: 0.1-1 s per task run while the API's SQLite is busy (benchmarks/README.md), so there
    the tasks run untagged."""
    if on_server():
        return task
    key = id(task)
    if key not in _UNTAGGED:  # the task is kept with its copy: a dead task's id could name another
        _UNTAGGED[key] = (task, task.with_options(tags=set()))  # type: ignore[attr-defined]
    return _UNTAGGED[key][1]


# What a task's line says of its output, when the manifest has it: (metric key, label, format).
SAID = (("rollout/reward_mean", "reward", ".3f"), ("rollout/response_len_mean", "tokens/response", ".1f"),
        ("advantage/abs_mean", "|advantage|", ".3f"), ("loss", "loss", "+.4f"), ("policy_version", "version", "d"))


def committed(storage: RunStorage, iteration: int, stage: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A task's stage (stages/run/iteration.py `committed`: the committed output, or made and
    committed now), and one line in the task run's log of what it did: rows, files, what it
    measured, seconds (or that it was committed before)."""
    out = it.committed(storage, iteration, stage, make)
    said = [f"{out['rows']} rows"] if isinstance(out.get("rows"), int) else []
    if out.get("files"):
        said.append(f"{len(out['files'])} file{'s' if len(out['files']) > 1 else ''}")
    values = {**out.get("metrics", {}), **{k: v for k, v in out.items() if k == "policy_version"}}
    said += [f"{label} {values[key]:{fmt}}" for key, label, fmt in SAID if isinstance(values.get(key), (int, float))]
    when = "committed before, reused" if out.get("reused") else f"{float(out.get('seconds', 0.0)):.2f} s"
    try:
        get_run_logger().info("%s of %s: %s (%s)", stage, storage.run, ", ".join(said) or "done", when)
    except Exception:  # noqa: BLE001 - outside a task run (a test calling the body): no log to write to
        pass
    return out


def run_tags(recipe: Recipe, run_name: str) -> AbstractContextManager[Any]:
    """Tags of every task and subflow run of a run (`unirl`, `recipe:<name>`, `run:<name>`), on a
    server only (see `staged`)."""
    return tags("unirl", f"recipe:{recipe.name}", f"run:{run_name}") if on_server() else nullcontext()


def storage_of(recipe: Recipe, run_name: str) -> RunStorage:
    return RunStorage(recipe.storage.root, run_name, recipe.storage.options)


def announce(logger: Any) -> Callable[[str], None]:
    """A worker group's news (starting, replaying): in the run's log and on the console, where a
    model that takes minutes to load should not look like a hang."""
    def log(message: str) -> None:
        logger.info(message)
        say(f"[unirl] {message}")

    return log


# Errors that the same inputs raise again: bad input or data (a ValueError: recipe, shard, image,
# scorer input, behaviour mismatch of a replay is a RuntimeError and is retried), a wrong type or key.
DETERMINISTIC = (ValueError, TypeError, KeyError)


def say_retry(task: Any, task_run: Any, state: Any) -> bool:
    """A task's `retry_condition_fn`: Prefect logs a retried failure at INFO, which `unirl` keeps
    off the console, so each retry gets one line there (the error's first line; the whole of it is
    in the run's log). A failure retries unless it is deterministic (DETERMINISTIC: the same inputs
    fail the same way, and a retry would only repeat it); how often is the task's `retries`."""
    data = getattr(state, "data", None)
    if isinstance(data, DETERMINISTIC):
        return False
    text = f"{type(data).__name__}: {data}" if isinstance(data, BaseException) else str(getattr(state, "message", "") or "")
    first = next((line for line in text.splitlines() if line.strip()), "(no message)")
    say(f"[unirl] {task.name} failed, retrying (attempt {int(task_run.run_count) + 1} of {int(task.retries) + 1}): {first[:500]}")
    return True


def group_of(recipe: Recipe, storage: RunStorage) -> ModelGroup:
    """The run's trainer: the process-wide worker group (tasks of one flow run share it)."""
    def make() -> WorkerGroup:
        return WorkerGroup(recipe, storage, init_weights=storage.weights_rel(0), log=announce(get_run_logger()),
                           launch_nodes=node_launcher(recipe, storage.run))

    return get_group(storage.url(), make)


def engine_of(recipe: Recipe, storage: RunStorage) -> RolloutEngine:
    """The run's rollout engine, from the recipe's `rollout.engine` (the engine registry): one per
    run and process, since a dedicated engine holds a server process and its loaded version."""
    key = storage.url()
    engine = _ENGINES.get(key)
    if engine is None:
        engine = engines.get(recipe.rollout.engine.name)(recipe, storage, group_of(recipe, storage))
        engine = _ENGINES[key] = agentic(engine, recipe, storage)  # multi-turn with tools: the recipe's `agent`
    return engine


def eval_engine_of(recipe: Recipe, storage: RunStorage) -> RolloutEngine:
    """Where held-out evaluation samples: the run's engine, except in async RL, where the engine
    belongs to the producer (which must not be moved to another version): the worker group."""
    if recipe.rollout.mode == "async":
        return agentic(in_group()(recipe, storage, group_of(recipe, storage)), recipe, storage)
    return engine_of(recipe, storage)


_PRODUCERS: dict[str, Any] = {}


def start_producer(recipe: Recipe, run_name: str, storage: RunStorage) -> None:
    """Start the async run's producer process (its own `rl-producer` flow run on this Prefect
    API); it dies with this process."""
    url = get_current_settings().api.url  # a server's, or the local API of `unirl run`: the producer reports there
    producer = _PRODUCERS[storage.url()] = ProducerProcess(recipe, run_name, api_url=url,
                                                           log=announce(get_run_logger()))
    producer.start()


def producer_alive(storage: RunStorage) -> Callable[[], None]:
    """What the trainer calls while it waits for a batch: restarts a dead producer, raises once
    it may not (no producer started in this process: nothing to check)."""
    producer = _PRODUCERS.get(storage.url())
    return producer.alive if producer is not None else (lambda: None)


def stop_producer(key: str) -> None:
    producer = _PRODUCERS.pop(key, None)
    if producer is not None:
        producer.stop()


def close_engine(key: str) -> None:
    engine = _ENGINES.pop(key, None)
    if engine is not None:
        engine.close()


def node_launcher(recipe: Recipe, run_name: str) -> NodeLauncher | None:
    """The run's way of starting its other nodes' agents (`train.agents.deployment`), or None
    (one node, or agents started by hand)."""
    agents = recipe.train.agents
    if recipe.train.nnodes == 1 or not agents.deployment:
        return None

    def launch(plan: GroupPlan, nodes: list[int]) -> None:
        from prefect.client.orchestration import get_client  # start-up time: prefect loads on first use, not when a recipe is read
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                deployment = client.read_deployment_by_name(agents.deployment)
            except ObjectNotFound:
                raise NodeSetupError(
                    f"train.agents.deployment: no deployment {agents.deployment!r} on the Prefect API "
                    f"({client.api_url}); deploy it (`prefect deploy --name {agents.deployment.split('/')[-1]}`) and run "
                    "against that server (PREFECT_API_URL), or leave it empty and start `unirl agent` on each node") from None
            pool = client.read_work_pool(deployment.work_pool_name) if deployment.work_pool_name else None
        declared = set(((pool.base_job_template or {}).get("variables") or {}).get("properties") or {}) if pool else set()
        params = {"recipe": recipe.model_dump(mode="json"), "run_name": run_name, "group": plan.group}
        for k, index in enumerate(nodes):
            run_deployment(
                agents.deployment, parameters={**params, "node_index": index}, timeout=0, as_subflow=False,
                work_queue_name=agents.work_queues[k] if agents.work_queues else None,
                job_variables={"node_index": index} if "node_index" in declared else None,
                tags=["unirl", f"run:{run_name}", f"group:{plan.group}"],
            )

    return launch

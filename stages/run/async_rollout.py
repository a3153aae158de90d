"""Async RL with a staleness bound: which policy version samples which iteration, and what the
trainer admits.

Staleness counts policy versions (updates). The trainer trains iteration j at version
v(j) = `version_of(j)` (j itself, or with rollout accumulation j // train.accumulate_rollouts,
stages/runtime/accumulation.py). The producer (flows/producer.py) samples iteration j with policy
version `behaviour_version(v(j))` = the newest sync version <= v(j) - max_staleness (0 at the
start), as soon as the trainer has published it, so it samples up to max_staleness updates ahead
while the trainer trains; each batch is one committed shard `iter-j/rollouts/part-000.arrow`
(stage `produce`), its rows stamped with the version the engine reports. The schedule is a
function of j alone, so an async run is as deterministic as a sync one and a resumed run repeats
what a killed one would have done.

The trainer's iteration j admits a batch's groups whose rows all have version >= v(j) -
max_staleness; groups with an older row (an engine whose weights changed under the run) are
dropped and counted (`rollout/stale_groups_dropped`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from unirl.stages.runtime.accumulation import version_of
from unirl.stages.runtime.sample import read_rollouts, write_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join


class ProducerError(RuntimeError):
    """The producer of an async run stopped, or its batch holds nothing the trainer may train on."""


def behaviour_version(version: int, max_staleness: int, every: int = 1) -> int:
    """The policy version the producer samples an iteration trained at `version` with: the newest
    version published for the engine (a multiple of `every`) that is at most version - max_staleness."""
    target = max(0, version - max_staleness)
    return target - target % every


def producer_version(recipe: Any, iteration: int) -> int:
    """The policy version the async producer samples batch `iteration` with: `behaviour_version`,
    or with partial rollouts (stages/engines/partial.py) one update ahead whatever max_staleness is
    (max_staleness bounds how many batches a cut sample spans)."""
    r = recipe.rollout
    lead = 1 if getattr(r, "partial", None) is not None else r.max_staleness
    return behaviour_version(version_of(recipe, iteration), lead, r.engine.sync.every)


def admit(table: pa.Table, version: int, max_staleness: int) -> tuple[pa.Table, dict[str, float]]:
    """The rows of whole groups whose every row has policy_version >= version - max_staleness
    (`version`: the one the trainer trains them at), and what was dropped. table: a rollouts table
    (sample_id, group_id, policy_version)."""
    floor = version - max_staleness
    versions = table.column("policy_version").to_pylist()
    groups = table.column("group_id").to_pylist()
    stale = {g for g, v in zip(groups, versions) if v < floor}
    kept = table.filter(pc.invert(pc.is_in(table.column("group_id"), value_set=pa.array(sorted(stale), pa.string()))))
    lag = [version - v for v in versions]
    return kept, {
        "rollout/stale_groups_dropped": float(len(stale)),
        "rollout/stale_samples_dropped": float(table.num_rows - kept.num_rows),
        "rollout/policy_lag_mean": float(sum(lag) / max(len(lag), 1)),
        "rollout/policy_lag_max": float(max(lag, default=0)),
    }


def collect(storage: RunStorage, recipe: Any, iteration: int, *, alive: Callable[[], None], poll_s: float = 0.05) -> dict[str, Any]:
    """Wait for the producer's committed batch of `iteration` (calling `alive()`, which raises
    when the producer is gone for good, while waiting), admit it, and return the generate
    manifest the rest of the iteration reads (its rollout files, the versions, what was dropped)."""
    start = time.perf_counter()
    while (produced := storage.stage_manifest(iteration, "produce")) is None:
        alive()
        time.sleep(poll_s)
    waited = time.perf_counter() - start
    table = read_rollouts(storage, produced["files"])
    version = version_of(recipe, iteration)
    kept, metrics = admit(table, version, recipe.rollout.max_staleness)
    files = produced["files"]
    if kept.num_rows == 0:
        raise ProducerError(f"{storage.url(iter_dir(iteration))}: every group of the producer's batch was sampled by a "
                            f"policy older than version {version - recipe.rollout.max_staleness} "
                            f"(max_staleness {recipe.rollout.max_staleness}); nothing to train on")
    if kept.num_rows < table.num_rows:
        rel = join(iter_dir(iteration), "rollouts", "admitted.arrow")
        write_shard(storage, rel, kept.sort_by("sample_id"))
        files = [rel]
    metrics.update(produced.get("metrics", {}))  # the producer's own (partial rollouts: what was cut and carried)
    metrics["time/wait_producer_s"] = waited
    return {"files": files, "rows": kept.num_rows, "policy_version": produced.get("policy_version"),
            "produced_s": produced.get("seconds", 0.0), "metrics": metrics, "seconds": waited}

"""What the benchmarks read back from a finished run folder."""
from __future__ import annotations

import json
from pathlib import Path


def iteration_metrics(run_dir: Path, iterations: int) -> list[dict[str, float]]:
    """Each iteration's metrics from its `_SUCCESS`, plus `time/wall_s` from iteration 1 on: the
    time between the previous commit and this one, i.e. the iteration's whole flow run (creation,
    tasks, tracking) and not only the part its own clock (`time/iteration_s`) sees."""
    done = [run_dir / f"iter-{i:06d}" / "_SUCCESS" for i in range(iterations)]
    out = [json.loads(p.read_text())["metrics"] for p in done]
    for m, before, after in zip(out[1:], done, done[1:]):
        m["time/wall_s"] = after.stat().st_mtime - before.stat().st_mtime
    return out


def steady_state(metrics: list[dict[str, float]], warmup: int) -> list[dict[str, float]]:
    """The iterations a per-iteration time is taken over: after `warmup` (and after iteration 0,
    which has no `time/wall_s`), without the last, which also checkpoints and publishes."""
    return metrics[max(warmup, 1):len(metrics) - 1]

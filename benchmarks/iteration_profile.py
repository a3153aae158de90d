"""Where the wall time of one RL iteration goes, for any recipe: runs `unirl run RECIPE` in this
process with timers around the pieces of an iteration and prints their medians over the steady
state (after `--warmup` iterations, without the last, which also checkpoints and publishes).

    python benchmarks/iteration_profile.py recipes/ar/quickstart.yaml --iterations 12 sft=null eval.enabled=false

Rows:
  prefect: subflow start    `rl_iteration(...)` called -> its function body starts (flow run creation,
                            parameter validation, Running state)
  prefect: subflow end      body returns -> the call returns (Completed state)
  prefect: task runs        in the body, everything outside the task functions (task-run creation
                            and states)
  worker: <cmd>             the worker group's own clock for a command (generate, train, save, ...)
  control: round trips      a command's wall time in the flow minus the worker's own clock
  flow: <task>              the task functions' own work in the flow process outside worker calls
                            (requests, scoring, advantages, manifests)
  run loop                  between iterations: evaluation check, MLflow, _SUCCESS, artifacts, progress
In each iteration the rows add up to its wall time (`total`); the medians printed add up about.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]


class Timeline:
    """(time, label) marks, cut into iterations from one `subflow>` to the next."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] = []

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter(), label))

    def iterations(self) -> list[list[tuple[float, str]]]:
        starts = [i for i, (_, label) in enumerate(self.marks) if label == "subflow>"]
        return [self.marks[a:b + 1] for a, b in zip(starts, starts[1:])]  # up to the next start


def breakdown(marks: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per row of one iteration (from its `subflow>` to the next one)."""
    out: dict[str, float] = defaultdict(float)
    t0, t_end = marks[0][0], marks[-1][0]
    stack: list[tuple[str, float, float]] = []  # open task: (name, start, seconds inside worker calls)
    body = body_end = returned = call_start = 0.0
    tasks = 0.0
    for t, label in marks:
        if label == "body>":
            out["prefect: subflow start"] += t - t0
            body = t
        elif label == "body<":
            body_end = t
        elif label == "subflow<":
            out["prefect: subflow end"] += t - body_end
            returned = t
        elif label.startswith("task>"):
            stack.append((label[5:], t, 0.0))
        elif label.startswith("task<"):
            name, start, inside = stack.pop()
            out[f"flow: {name}"] += (t - start) - inside
            tasks += t - start
        elif label.startswith("call>"):
            call_start = t
        elif label.startswith("call<"):
            cmd, worker_s = label[5:].split(" ")
            wall = t - call_start
            out[f"worker: {cmd}"] += float(worker_s)
            out["control: round trips"] += wall - float(worker_s)
            if stack:
                name, start, inside = stack[-1]
                stack[-1] = (name, start, inside + wall)
    out["prefect: task runs"] = (body_end - body) - tasks
    out["run loop"] = t_end - returned
    out["total"] = t_end - t0
    return dict(out)


def instrument(timeline: Timeline) -> None:
    """Timers around the subflow, its body, the five task functions and worker-group calls."""
    import flows.rl as rl
    import tasks.advantage
    import tasks.generate
    import tasks.score
    import tasks.sync
    import tasks.train
    from stages.workers.group import WorkerGroup

    def around(fn: Callable[..., Any], before: str, after: Callable[[Any], str]) -> Callable[..., Any]:
        # A function compiled in `fn`'s module, so Prefect still resolves its annotations.
        ns = dict(fn.__globals__, _fn=fn, _mark=timeline.mark, _before=before, _after=after)
        exec("def wrapped(*a, **k):\n    _mark(_before)\n    out = _fn(*a, **k)\n    _mark(_after(out))\n    return out", ns)
        wrapped = ns["wrapped"]
        for attr in ("__name__", "__qualname__", "__doc__", "__module__", "__annotations__", "__defaults__", "__kwdefaults__"):
            setattr(wrapped, attr, getattr(fn, attr))
        wrapped.__wrapped__ = fn
        return wrapped

    rl.rl_iteration.fn = around(rl.rl_iteration.fn, "body>", lambda _: "body<")
    for t in (tasks.generate.generate, tasks.score.score, tasks.advantage.advantage, tasks.train.train, tasks.sync.sync):
        t.fn = around(t.fn, f"task>{t.name}", lambda _, n=t.name: f"task<{n}")
    subflow = rl.rl_iteration

    class Subflow:
        def __call__(self, *a: Any, **k: Any) -> Any:
            timeline.mark("subflow>")
            out = subflow(*a, **k)
            timeline.mark("subflow<")
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(subflow, name)

    rl.rl_iteration = Subflow()
    call = WorkerGroup.call

    def timed_call(self: WorkerGroup, cmd: str, **kwargs: Any) -> Any:
        timeline.mark(f"call>{cmd}")
        out = call(self, cmd, **kwargs)
        timeline.mark(f"call<{cmd} {float(out.get('seconds', 0.0)) if isinstance(out, dict) else 0.0}")
        return out

    WorkerGroup.call = timed_call  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. sft=null eval.enabled=false")
    args = parser.parse_intermixed_args()
    if args.iterations < args.warmup + 3:
        parser.error("--iterations must leave at least two steady-state iterations after --warmup")
    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="unirl-profile-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
    (work / "prefect").mkdir(parents=True, exist_ok=True)
    timeline = Timeline()
    instrument(timeline)
    from flows.cli import main as cli

    code = cli(["run", args.recipe, f"storage.root={work}", "--run-name", "profile", f"iterations={args.iterations}",
                f"checkpoint_every={args.iterations}", *args.overrides])
    if code:
        return code
    # The last iteration has no following `subflow>`: it (and its checkpoint) is left out.
    rows = [breakdown(m) for m in timeline.iterations()[args.warmup:]]
    if not rows:
        print("error: no steady-state iterations were timed", file=sys.stderr)
        return 1
    keys = sorted({k for r in rows for k in r if k != "total"}, key=lambda k: (k.split(":")[0], k))
    total = statistics.median(r["total"] for r in rows)
    print(f"\n{args.recipe}: median over {len(rows)} steady-state iterations (ms)")
    for k in keys + ["total"]:
        v = statistics.median(r.get(k, 0.0) for r in rows)
        print(f"  {k:28s} {v * 1000:9.1f}  {100 * v / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

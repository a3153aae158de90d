"""Where the wall time of one RL iteration goes, for any recipe: runs `unirl run RECIPE` in this
process with timers around the pieces of an iteration and prints their medians over the steady
state (after `--warmup` iterations, without the last, which also checkpoints and publishes).

    python benchmarks/iteration_profile.py recipes/ar/quickstart.yaml --iterations 12 sft=null eval.enabled=false

Each iteration's window runs from its turn (its body may start) to the next iteration's turn.
With iteration flow runs started ahead (flows/ahead.py; `--ahead on`, the default as in `unirl run`;
`off` never) the next one's start overlaps this one's work. Rows:
  prefect: task runs        in the body, everything outside the task functions (task-run creation
                            and states)
  prefect: subflow end      body returns -> the call returns (Completed state); started ahead, 0:
                            the run loop goes on with the body's result while Prefect ends the run
  prefect: subflow start (not overlapped)
                            the run loop asked for the next iteration -> its turn begins: the part
                            of the next flow run's start (creation, Running state) not hidden
  worker: <cmd>             the worker group's own clock for a command (generate, train, save, ...)
  control: round trips      a command's wall time in the flow minus the worker's own clock
  flow: <task>              the task functions' own work in the flow process outside worker calls
                            (requests, scoring, advantages, manifests)
  run loop                  between iterations: evaluation check, _SUCCESS, queueing the report
In each iteration the rows add up to its window (`total`); the medians printed add up about.
The fixed orchestration cost is the prefect rows, the run loop and the control round trips.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Timeline:
    """(time, label, iteration) marks from every thread (iteration flow runs start on threads of
    their own, flows/ahead.py); `iteration` is None for worker calls, which belong to the window
    they fall in."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str, int | None]] = []
        self._lock = __import__("threading").Lock()

    def mark(self, label: str, iteration: int | None = None) -> None:
        with self._lock:
            self.marks.append((time.perf_counter(), label, iteration))

    def first(self, label: str, iteration: int) -> float | None:
        return next((t for t, lab, it in self.marks if lab == label and it == iteration), None)

    def at(self, label: str, iteration: int) -> float:
        """`first`, for a mark the iteration must have."""
        t = self.first(label, iteration)
        if t is None:
            raise ValueError(f"iteration {iteration} has no {label!r} mark")
        return t


def breakdown(timeline: Timeline, i: int) -> dict[str, float]:
    """Seconds per row of iteration i's window: from its turn (`gate<`: its body may start) to
    the next iteration's turn. The rows add up to the window."""
    out: dict[str, float] = defaultdict(float)
    t0, t_end = timeline.at("gate<", i), timeline.at("gate<", i + 1)
    body_end = timeline.at("body<", i)
    # One after the other, the run loop goes on when the flow run has ended; started ahead, when
    # its body has handed over its result (Prefect ends the flow run meanwhile, on its thread).
    ahead = any(label == "take>" for _, label, _ in timeline.marks)
    returned = body_end if ahead else timeline.at("subflow<", i)
    # The run loop ends when it asks for the next iteration: a flow run it starts now (one after
    # the other), or one started ahead that it lets go (`take>`).
    asked = [t for t in (timeline.first("take>", i + 1), timeline.first("subflow>", i + 1)) if t is not None and t >= returned]
    loop_end = min(asked) if asked else t_end
    tasks = 0.0
    open_tasks: list[tuple[str, float, float]] = []
    call_start = 0.0
    for t, label, it in timeline.marks:
        if not t0 <= t <= t_end or (it is not None and it != i):
            continue
        if label.startswith("task>"):
            open_tasks.append((label[5:], t, 0.0))
        elif label.startswith("task<") and open_tasks:
            name, start, inside = open_tasks.pop()
            out[f"flow: {name}"] += (t - start) - inside
            tasks += t - start
        elif label.startswith("call>"):
            call_start = t
        elif label.startswith("call<"):
            cmd, worker_s = label[5:].split(" ")
            out[f"worker: {cmd}"] += float(worker_s)
            out["control: round trips"] += (t - call_start) - float(worker_s)
            if open_tasks:
                name, start, inside = open_tasks[-1]
                open_tasks[-1] = (name, start, inside + t - call_start)
            elif returned <= t:  # a held-out evaluation's calls in the run loop
                out["run loop"] -= t - call_start
    out["prefect: task runs"] = (body_end - t0) - tasks
    out["prefect: subflow end"] = returned - body_end
    out["run loop"] += loop_end - returned
    out["prefect: subflow start (not overlapped)"] = t_end - loop_end
    out["total"] = t_end - t0
    return dict(out)


def overlapped_start(timeline: Timeline, i: int) -> float:
    """The whole of iteration i's flow-run start (call -> its body's turn could begin), overlapped
    or not: what starting ahead hides."""
    return timeline.at("gate>", i) - timeline.at("subflow>", i)


def instrument(timeline: Timeline) -> None:
    """Timers around the iteration subflow, its gate, its body, the five task functions,
    `Ahead.take` and worker-group calls."""
    import unirl.flows.ahead
    import unirl.flows.shapes as shapes
    import unirl.tasks.advantage
    import unirl.tasks.generate
    import unirl.tasks.score
    import unirl.tasks.sync
    import unirl.tasks.train
    from unirl.stages.workers.group import WorkerGroup

    def around(fn: Callable[..., Any], before: str, after: str) -> Callable[..., Any]:
        # A function compiled in `fn`'s module, so Prefect still resolves its annotations; the
        # iteration is the third positional argument (recipe, run_name, iteration) or `iteration`.
        ns = dict(fn.__globals__, _fn=fn, _mark=timeline.mark, _before=before, _after=after)
        exec("def wrapped(*a, **k):\n    i = a[2] if len(a) > 2 else k.get('iteration')\n    _mark(_before, i)\n"
             "    out = _fn(*a, **k)\n    _mark(_after, i)\n    return out", ns)
        wrapped = ns["wrapped"]
        for attr in ("__name__", "__qualname__", "__doc__", "__module__", "__annotations__", "__defaults__", "__kwdefaults__"):
            setattr(wrapped, attr, getattr(fn, attr))
        wrapped.__wrapped__ = fn
        return wrapped

    shapes.rl_iteration.fn = around(shapes.rl_iteration.fn, "body>", "body<")
    tasks = unirl.tasks
    for t in (tasks.generate.generate, tasks.score.score, tasks.advantage.advantage, tasks.train.train, tasks.sync.sync):
        t.fn = around(t.fn, f"task>{t.name}", f"task<{t.name}")
    wait_turn = shapes.wait_turn

    def timed_wait_turn(run_name: str, iteration: int) -> bool:
        timeline.mark("gate>", iteration)
        out = wait_turn(run_name, iteration)
        timeline.mark("gate<", iteration)
        return out

    shapes.wait_turn = timed_wait_turn
    subflow = shapes.rl_iteration

    class Subflow:
        def __call__(self, recipe: Any, run_name: str, iteration: int) -> Any:
            timeline.mark("subflow>", iteration)
            out = subflow(recipe, run_name, iteration)
            timeline.mark("subflow<", iteration)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(subflow, name)

    shapes.run_shapes._entries["single"] = dataclasses.replace(shapes.run_shapes.get("single"), iteration=Subflow())
    take = unirl.flows.ahead.Ahead.take

    def timed_take(self: Any, i: int) -> Any:
        timeline.mark("take>", i)
        return take(self, i)

    unirl.flows.ahead.Ahead.take = timed_take  # type: ignore[method-assign]
    call = WorkerGroup.call

    def timed_call(self: WorkerGroup, cmd: str, **kwargs: Any) -> Any:
        timeline.mark(f"call>{cmd}")
        out = call(self, cmd, **kwargs)
        timeline.mark(f"call<{cmd} {float(out.get('seconds', 0.0)) if isinstance(out, dict) else 0.0}")
        return out

    WorkerGroup.call = timed_call  # type: ignore[method-assign,assignment]


def pin_worker_group(cpus: set[int], others: set[int]) -> None:
    """Every thread of the worker group's processes on `cpus`, this process (the flow) on `others`;
    the ephemeral API server, started later by this process, inherits `others`. So the model's
    work has cores of its own, as on a GPU host, and the flow's bookkeeping the rest."""
    from unirl.stages.workers.group import WorkerGroup

    os.sched_setaffinity(0, others)
    start = WorkerGroup.start

    def pinned_start(self: WorkerGroup, checkpoint: Any) -> None:
        start(self, checkpoint)
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        for proc in [root, *root.children(recursive=True)]:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, cpus)

    WorkerGroup.start = pinned_start  # type: ignore[method-assign]


def keep_tags() -> None:
    """Every module's `staged` returns the task as it is, tags and all (the A/B of tasks/common.py `staged`)."""
    import unirl.flows.rl  # noqa: F401 - imports every module that calls `staged`
    from unirl.tasks import common

    original = common.staged
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("unirl.") and getattr(module, "staged", None) is original:
            module.staged = lambda task: task  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ahead", choices=("on", "off"), default="on",
                        help="start each iteration's flow run while the previous one works (flows/ahead.py; the "
                        "default, as in unirl run) or not: the A/B of starting them ahead")
    parser.add_argument("--tags", choices=("untagged", "tagged"), default="untagged",
                        help="tasks on the ephemeral API run untagged (tasks/common.py `staged`, as in unirl run) or "
                        "keep their tags (`gpu`: a concurrency-slot request per task run): the A/B of `staged`")
    parser.add_argument("--pin-worker", type=int, default=None, metavar="CPU",
                        help="the worker group on core CPU (one thread per rank), the flow and Prefect on the others")
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
    if args.pin_worker is not None:
        os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank on its one core
        pin_worker_group({args.pin_worker}, set(range(os.cpu_count() or 1)) - {args.pin_worker})
    os.environ["UNIRL_OVERLAP_ITERATIONS"] = args.ahead
    from unirl.flows.cli import main as cli

    if args.tags == "tagged":
        keep_tags()

    code = cli(["run", args.recipe, f"storage.root={work}", "--run-name", "profile", f"iterations={args.iterations}",
                f"checkpoint_every={args.iterations}", *args.overrides])
    if code:
        return code
    # The last iteration has no following turn: it (and its checkpoint) is left out.
    steady = range(args.warmup, args.iterations - 1)
    rows = [breakdown(timeline, i) for i in steady]
    hidden = statistics.median(overlapped_start(timeline, i) for i in steady)
    if not rows:
        print("error: no steady-state iterations were timed", file=sys.stderr)
        return 1
    keys = sorted({k for r in rows for k in r if k != "total"}, key=lambda k: (k.split(":")[0], k))
    total = statistics.median(r["total"] for r in rows)
    mode = "started ahead" if any(label == "take>" for _, label, _ in timeline.marks) else "one after the other"
    print(f"\n{args.recipe}: iteration flow runs {mode}; median over {len(rows)} steady-state iterations (ms)")
    for k in keys + ["total"]:
        v = statistics.median(r.get(k, 0.0) for r in rows)
        print(f"  {k:40s} {v * 1000:9.1f}  {100 * v / total:5.1f}%")
    fixed = statistics.median(sum(v for k, v in r.items() if k.startswith(("prefect", "run loop", "control"))) for r in rows)
    print(f"  {'fixed orchestration cost (prefect, run loop, control)':40s} {fixed * 1000:9.1f}")
    print(f"  (a flow run's whole start, overlapped or not: {hidden * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A long run, watched: does anything grow that should not?

    python benchmarks/soak.py [--iterations 500] [--every 50] [--work DIR]

Runs `unirl run recipes/ar/tiny.yaml iterations=N` on its own ephemeral Prefect API (its database
under DIR/prefect) and, every `--every` iterations, prints the RSS of the flow process, of the
worker ranks and of the Prefect API server, the seconds per iteration over the last window (the
median over the window's iterations of the time between consecutive `_SUCCESS` markers, i.e.
whole iterations: a stall of the machine moves a mean, not a median), the Prefect database's size
and the run folder's size. At the end it compares the last window with the first: RSS and seconds per
iteration should stay within 10%, and storage grow linearly (the same bytes per iteration).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def done(run: Path) -> int:
    return sum(1 for _ in run.glob("iter-*/_SUCCESS"))


def iteration_seconds(run: Path, first: int, end: int) -> float:
    """Median wall time of iterations [first, end): between consecutive `_SUCCESS` commits."""
    import statistics

    stamps = [(run / f"iter-{i:06d}" / "_SUCCESS").stat().st_mtime for i in range(first - 1, end)]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def rss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def family(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The flow process, its worker ranks and the Prefect API server among its descendants."""
    out: dict[str, list[psutil.Process]] = {"flow": [root], "workers": [], "prefect": []}
    for child in root.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "unirl.stages.workers" in cmd:
            out["workers"].append(child)
        elif "uvicorn" in cmd or "prefect" in cmd and "server" in cmd:
            out["prefect"].append(child)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="unirl-soak-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "UNIRL_FAULTS"))}
    work.mkdir(parents=True, exist_ok=True)
    env["PREFECT_HOME"] = str(work / "prefect")
    run = work / "runs" / "soak"
    cmd = [sys.executable, "-m", "unirl.flows.cli", "run", str(REPO / "recipes" / "ar" / "tiny.yaml"), f"iterations={args.iterations}",
           f"storage.root={work / 'runs'}", "--run-name", "soak", *args.overrides]
    log = open(work / "soak.log", "w")  # noqa: SIM115 - the run's console, kept for reading afterwards
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    print(f"soak: {' '.join(cmd[3:])}\n  work folder {work}", flush=True)
    print(f"{'iter':>5} {'flow MiB':>9} {'workers MiB':>12} {'prefect MiB':>12} {'s/iter':>7} {'prefect db MiB':>15} "
          f"{'run folder MiB':>15}", flush=True)
    rows, mark, last = [], args.every, None
    latest = {"flow": 0.0, "workers": 0.0, "prefect": 0.0}  # each kind's RSS at the last tick it was alive
    while proc.poll() is None:
        time.sleep(0.5)
        procs = family(root)
        for kind, members in procs.items():
            latest[kind] = rss_mib(members) or latest[kind]  # the last iteration's row: the ranks may have exited
        n = done(run)
        if last is None and n >= 1:  # windows start at the first commit: start-up is not an iteration
            last = 1
        if n < mark or last is None:
            continue
        per_iter = iteration_seconds(run, last, n)
        db = sum(folder_bytes(p) if p.is_dir() else p.stat().st_size for p in (work / "prefect").glob("*.db*"))
        row = {"iter": n, "flow": latest["flow"], "workers": latest["workers"], "prefect": latest["prefect"],
               "s_iter": per_iter, "db": db / 2**20, "run": folder_bytes(run) / 2**20}
        rows.append(row)
        print(f"{n:5d} {row['flow']:9.0f} {row['workers']:12.0f} {row['prefect']:12.0f} {per_iter:7.2f} {row['db']:15.1f} "
              f"{row['run']:15.1f}", flush=True)
        last, mark = n, mark + args.every
    log.close()
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}); see {work / 'soak.log'}", file=sys.stderr)
        return 1
    if len(rows) < 2:
        return 0
    first, end = rows[0], rows[-1]
    print("\nlast window vs the first (target: within 10%):")
    for key, name in (("flow", "flow RSS"), ("workers", "workers RSS"), ("prefect", "Prefect API RSS"), ("s_iter", "s/iter")):
        change = end[key] / first[key] - 1 if first[key] else 0.0
        print(f"  {name:16s} {first[key]:8.2f} -> {end[key]:8.2f}  {change:+.1%}  {'ok' if abs(change) <= 0.10 else 'OVER'}")
    growth = [(b["run"] - a["run"]) / (b["iter"] - a["iter"]) for a, b in zip(rows, rows[1:])]
    db_growth = [(b["db"] - a["db"]) / (b["iter"] - a["iter"]) for a, b in zip(rows, rows[1:])]
    print(f"  run folder grows {min(growth) * 1024:.0f}-{max(growth) * 1024:.0f} KiB per iteration; "
          f"Prefect database {min(db_growth) * 1024:.0f}-{max(db_growth) * 1024:.0f} KiB per iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())

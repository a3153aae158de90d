"""Seconds per iteration of the AR loop at 1x, 2x and 4x the quickstart batch, side by side in one
run (cost should grow at most linearly), plus the orchestration + storage share of an iteration:
wall time of the iteration (between its commits) minus the time its five stages report.

    python benchmarks/scaling.py --iterations 6
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _runs import iteration_metrics, steady_state

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "ar" / "quickstart.yaml"
STAGES = ("generate", "score", "advantage", "train", "sync")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unirl-scaling-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    sys.path.insert(0, str(REPO))
    from unirl.stages.recipe import load_recipe

    base = load_recipe(QUICKSTART, args.overrides).rollout.prompts_per_iteration
    rows = []
    for scale in (1, 2, 4):
        name = f"x{scale}"
        cmd = [sys.executable, "-m", "unirl.flows.cli", "run", str(QUICKSTART), f"storage.root={work}", "--run-name", name,
               "sft=null", "eval.enabled=false", f"iterations={args.iterations}", f"checkpoint_every={args.iterations}",
               f"rollout.prompts_per_iteration={base * scale}", *args.overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        steady = steady_state(iteration_metrics(work / name, args.iterations), args.warmup)
        total = statistics.median(m["time/wall_s"] for m in steady)
        staged = statistics.median(sum(m[f"time/{s}_s"] for s in STAGES) for m in steady)
        rows.append((scale, base * scale, total, {s: statistics.median(m[f"time/{s}_s"] for m in steady) for s in STAGES}, total - staged))
    print(f"{'batch':>6s} {'prompts':>8s} {'s/iter':>8s} {'vs 1x':>6s} " + " ".join(f"{s:>9s}" for s in STAGES) + f" {'overhead':>9s}")
    for scale, prompts, total, stages, overhead in rows:
        per_stage = " ".join(f"{stages[s]:9.2f}" for s in STAGES)
        print(f"{scale:>5d}x {prompts:>8d} {total:8.2f} {total / rows[0][2]:6.2f} {per_stage} {overhead:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One FlowGRPO iteration of a flow family's recipe (default: the diffusion quickstart, SD3) through
the full flow (Prefect tasks, Arrow shards in run storage, the torchrun FSDP2 worker group) and the
same math in a minimal in-process loop (`unirl.stages.run.loop.InProcessLoop`: the same worker, policy,
algorithm and train stack on in-memory storage), side by side, at 1x, 2x and 4x the group size.
Prints seconds per iteration at steady state, the flow/loop ratio (target: at most 1.15) and how
cost grows with the batch.

    python benchmarks/diffusion_step.py --iterations 8 --warmup 3 [--repeats 3] [key=value ...]
    python benchmarks/diffusion_step.py --family wan --scales 1   # a video family (its recipe in RECIPES)

Both sides start from the same tiny random model (no SFT: speed does not depend on the weights) and
run in their own process with the same number of threads. With `--repeats N` the two sides
alternate N times per group size (flow, loop, flow, loop, ...) and the ratio is the median of the
N pairs: on a shared 2-core VM either side alone moves by up to 10% between runs minutes apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _runs import iteration_metrics, steady_state

REPO = Path(__file__).resolve().parents[1]
# The recipe each family is measured with: its quickstart where it has one.
RECIPES = {"sd3": "diffusion/quickstart.yaml", "flux2_klein": "diffusion/flux2_klein.yaml",
           "qwen_image": "diffusion/qwen_image.yaml", "wan": "video/quickstart.yaml",
           "hunyuan_video": "video/hunyuan_video.yaml"}
STAGES = ("generate", "score", "advantage", "train", "sync")


def flow_run(recipe: Path, work: Path, name: str, iterations: int, overrides: list[str], env: dict[str, str]) -> list[dict]:
    cmd = [sys.executable, "-m", "unirl.flows.cli", "run", str(recipe), f"storage.root={work}", "--run-name", name,
           "sft=null", "eval.enabled=false", "tracking.preview_every=0", f"iterations={iterations}",
           f"checkpoint_every={iterations}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return iteration_metrics(work / name, iterations)


def loop_run(recipe: Path, weights: Path, iterations: int, overrides: list[str], env: dict[str, str]) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--loop", str(weights), "--recipe", str(recipe),
           "--iterations", str(iterations), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def in_process(recipe_path: Path, weights: str, iterations: int, overrides: list[str]) -> int:
    """The loop side, in this process: one JSON line of per-iteration metrics."""
    sys.path.insert(0, str(REPO))
    import torch

    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.loop import InProcessLoop

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    recipe = load_recipe(recipe_path, ["sft=null", *overrides])
    loop = InProcessLoop(recipe, weights)
    out = []
    for i in range(iterations):
        start = time.perf_counter()
        m = loop.iteration(i)
        m["time/iteration_s"] = time.perf_counter() - start
        out.append(m)
    print(json.dumps(out))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the medians (start-up, caches)")
    parser.add_argument("--scales", default="1,2,4", help="group-size multiples")
    parser.add_argument("--repeats", type=int, default=1, help="alternating flow/loop pairs per group size")
    parser.add_argument("--family", default="sd3", choices=sorted(RECIPES), help="model.kind to measure (its recipe: RECIPES)")
    parser.add_argument("--recipe", default=None, help="a recipe instead of the family's")
    parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both sides")
    args = parser.parse_args()
    recipe = Path(args.recipe) if args.recipe else REPO / "recipes" / RECIPES[args.family]
    if args.loop:
        return in_process(recipe, args.loop, args.iterations, args.overrides)
    sys.path.insert(0, str(REPO))
    from unirl.stages.recipe import load_recipe

    work = Path(tempfile.mkdtemp(prefix="unirl-diffusion-bench-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING",
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    loaded = load_recipe(recipe, ["sft=null", *args.overrides])
    print(f"recipe {recipe.relative_to(REPO) if recipe.is_relative_to(REPO) else recipe} (model.kind {loaded.model.kind})", flush=True)
    base = loaded.rollout.group_size
    rows = []
    for scale in (int(s) for s in args.scales.split(",")):
        over = [*args.overrides, f"rollout.group_size={base * scale}"]
        pairs, flows = [], []
        for r in range(args.repeats):
            name = f"x{scale}" + (f"-{r}" if r else "")
            flow = steady_state(flow_run(recipe, work, name, args.iterations, over, env), args.warmup)
            loop = steady_state(loop_run(recipe, work / name / "weights" / "v000000", args.iterations, over, env), args.warmup)
            pairs.append((statistics.median(m["time/wall_s"] for m in flow), statistics.median(m["time/iteration_s"] for m in loop)))
            flows += flow
            if args.repeats > 1:
                print(f"  {scale}x pair {r + 1}/{args.repeats}: flow {pairs[-1][0]:.2f} s/it, loop {pairs[-1][1]:.2f} s/it, "
                      f"ratio {pairs[-1][0] / pairs[-1][1]:.3f}", flush=True)
        ratio = statistics.median(f / lp for f, lp in pairs)
        f, lp = statistics.median(f for f, _ in pairs), statistics.median(lp for _, lp in pairs)
        staged = statistics.median(sum(m.get(f"time/{s}_s", 0.0) for s in STAGES) for m in flows)
        stages = {s: statistics.median(m.get(f"time/{s}_s", 0.0) for m in flows) for s in STAGES}
        rows.append((scale, base * scale, f, lp, f - staged, stages, ratio))
    print(f"{'group':>6s} {'size':>5s} {'flow s/it':>10s} {'loop s/it':>10s} {'ratio':>6s} {'flow vs 1x':>10s} "
          f"{'loop vs 1x':>10s} {'orchestration':>13s} " + " ".join(f"{s:>9s}" for s in STAGES))
    for scale, size, f, lp, overhead, stages, ratio in rows:
        print(f"{scale:>5d}x {size:>5d} {f:10.2f} {lp:10.2f} {ratio:6.2f} {f / rows[0][2]:10.2f} {lp / rows[0][3]:10.2f} "
              f"{overhead:13.2f} " + " ".join(f"{stages[s]:9.2f}" for s in STAGES))
    print(f"steady-state ratio flow/loop at {rows[0][0]}x: {rows[0][6]:.3f} (target <= 1.15)"
          + (f", median of {args.repeats} alternating pairs" if args.repeats > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

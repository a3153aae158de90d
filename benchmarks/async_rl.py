"""Seconds per iteration of trainside rollout, a dedicated engine in sync RL, and the same engine in
async RL (max_staleness 1), side by side in one run, with the trainer and the engine each pinned
to one core: `unirl run` and its worker group under `taskset -c 0`, the engine server launched on
core 1 (`rollout.engine.cpus=[1]`, one thread; the async producer, the engine's client, runs there
too). The geometry makes generation and training take
similar time, so sync pays gen + train per iteration and async about the larger of the two.

    python benchmarks/async_rl.py                     # 10 iterations each, steady-state medians
    python benchmarks/async_rl.py --iterations 14 rollout.max_new_tokens=16

Also printed: where an iteration's time goes (generate = the wait for rollouts in async), and the
policy lag of the rows trained on.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import iteration_metrics, steady_state  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ar" / "quickstart.yaml"
# No warm start, no evaluation: only the RL iterations are timed. 384 prompts x 8 samples of up
# to 12 tokens on the quickstart's tiny Qwen3, every sample of a batch generated together (the
# engine's `max_batch` at least the batch, as the trainside sampler does): sampling (one core) and
# training (one core) each take about a second (2026-12-03: generate 0.8-1.0 s, train 0.9-1.1 s),
# against about a quarter second of fixed cost per iteration (its Prefect flow run, tracking) that
# no overlap removes. At the engine's default max_batch (64) it samples the batch in 48 sequential
# passes, 1.9 s against the trainer's 0.9 s, and async can only be as fast as the engine.
GEOMETRY = ["sft=null", "eval.enabled=false", "tracking.preview_every=0", "tracking.registry=false",
            "rollout.prompts_per_iteration=384", "rollout.group_size=8", "rollout.max_new_tokens=12",
            "train.micro_batch_size=384", "checkpoint_every=1000"]
ENGINE = ["rollout.engine.name=engine_server", "rollout.engine.cpus=[1]", "rollout.engine.threads=1",
          "rollout.engine.max_batch=4096"]
SETUPS = {
    "trainside": [],
    "engine sync": ENGINE,
    "engine async": [*ENGINE, "rollout.mode=async", "rollout.max_staleness=1", "rollout.correction={}"],
}


def run(name: str, extra: list[str], work: Path, iterations: int, overrides: list[str]) -> dict[str, float]:
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "OMP_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "unirl.flows.cli", "run", str(RECIPE), f"storage.root={work}",
           "--run-name", name.replace(" ", "-"), f"iterations={iterations}", *GEOMETRY, *extra, *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: unirl exited {proc.returncode}\n{proc.stderr[-4000:]}")
    metrics = steady_state(iteration_metrics(work / name.replace(" ", "-"), iterations), warmup=2)
    med = lambda key: statistics.median(m.get(key, 0.0) for m in metrics)  # noqa: E731
    return {"s/iter": med("time/wall_s"), "generate": med("time/generate_s"), "train": med("time/train_s"),
            "sync": med("time/sync_s"), "lag": med("rollout/policy_lag_mean"), "wall": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides for every setup")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs two cores: the trainer on core 0, the engine on core 1")
    work = Path(tempfile.mkdtemp(prefix="unirl-async-"))
    rows = {name: run(name, extra, work, args.iterations, args.overrides) for name, extra in SETUPS.items()}
    print(f"steady-state medians of {args.iterations} iterations (2 warm-up, the last left out), trainer on core 0, "
          "engine on core 1")
    print(f"{'setup':14s} {'s/iter':>7s} {'generate':>9s} {'train':>7s} {'sync':>7s} {'lag':>5s} {'run s':>6s}")
    for name, r in rows.items():
        print(f"{name:14s} {r['s/iter']:7.3f} {r['generate']:9.3f} {r['train']:7.3f} {r['sync']:7.3f} {r['lag']:5.1f} "
              f"{r['wall']:6.0f}")
    ratio = rows["engine sync"]["s/iter"] / rows["engine async"]["s/iter"]
    print(f"async speed-up over sync: {ratio:.2f}x (target >= 1.4x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Async RL with partial rollouts against without, on a task with long-tailed answers
(recipes/ar/partial.yaml: write back the prompt's digits, 85% of 1-3 digits, 15% of 4-24): per seed,
the RL iterations' seconds (the console's, iterations 1.. ; iteration 0 starts the engine) and the
held-out gain on the test split, side by side; and where an iteration's time goes (means over
iterations 1..): the producer's seconds per batch (its weight load included), the trainer's wait
for the batch, the train step's seconds.

    OMP_NUM_THREADS=1 python benchmarks/partial_rollouts.py --seeds 0 1 2

`without` is the same recipe with `rollout.partial=null rollout.max_staleness=1`: the producer one
update ahead in both, so the two differ in whether a batch waits for its longest answer.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from quickstart_seeds import evaluations, run, seed_overrides  # noqa: E402

RECIPE = str(REPO / "recipes/ar/partial.yaml")
SETTINGS = {"partial": [], "without": ["rollout.partial=null", "rollout.max_staleness=1"]}
ITER = re.compile(r"\] iter-(\d+) \(\d+/\d+\) .* ([0-9.]+)s$")


def iteration_seconds(log: Path) -> list[float]:
    """The seconds the console reports for each RL iteration after the first."""
    out = [(int(m[1]), float(m[2])) for line in log.read_text().splitlines() if (m := ITER.search(line))]
    return [s for i, s in out if i > 0]


def breakdown(run: Path) -> tuple[float, float, float]:
    """Means over iterations 1.. of the producer's seconds per batch (its weight load included),
    the trainer's wait for it and the train step's seconds (the manifests')."""
    produce, wait, train = [], [], []
    for i in range(1, len(list(run.glob("iter-*")))):
        d = run / f"iter-{i:06d}"
        if not (d / "train.json").exists():
            break
        produce.append(json.loads((d / "manifests/produce.json").read_text())["seconds"])
        wait.append(json.loads((d / "manifests/generate.json").read_text())["metrics"]["time/wait_producer_s"])
        train.append(json.loads((d / "train.json").read_text()).get("seconds", 0.0))
    return statistics.mean(produce), statistics.mean(wait), statistics.mean(train)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", help="a folder of an earlier call: its finished runs are read, not run again")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both settings")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="unirl-partial-"))
    print(f"runs and their console logs: {work}", flush=True)
    print(f"{'setting':<8} {'seed':>4} {'s/iter':>7} {'wall s':>7}  {'acc SFT':>7} {'acc RL':>7} {'gain':>7}  "
          f"{'avg@k SFT':>9} {'avg@k RL':>8} {'gain':>7}  {'produce':>7} {'wait':>5} {'train':>5}", flush=True)
    for seed in args.seeds:
        for setting, extra in SETTINGS.items():
            name = f"{setting}{seed}"
            wall = float("nan")  # a finished run of an earlier call: read, not timed
            if not (work / name / "_DONE").exists():
                wall, _ = run(RECIPE, name, [*seed_overrides(RECIPE, seed), *extra, *args.overrides], work, dict(os.environ))
                (work / name / "_DONE").touch()
            _, before, after = evaluations(work, name, "test")
            k = next(key for key in before if key.startswith("test/avg_at_"))
            per_iter = statistics.mean(iteration_seconds(work / f"{name}.log"))
            acc0, acc1, avg0, avg1 = before["test/accuracy"], after["test/accuracy"], before[k], after[k]
            produce, wait, train = breakdown(work / name)
            print(f"{setting:<8} {seed:>4} {per_iter:>7.3f} {wall:>7.0f}  {acc0:>7.3f} {acc1:>7.3f} {acc1 - acc0:>+7.3f}  "
                  f"{avg0:>9.3f} {avg1:>8.3f} {avg1 - avg0:>+7.3f}  {produce:>7.3f} {wait:>5.3f} {train:>5.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

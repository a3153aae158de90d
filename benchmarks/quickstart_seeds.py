"""A quickstart (SFT then RL) for several seeds: wall time and the held-out score after SFT and
after RL, per seed, read from the run's own evaluations (`eval/<version>/metrics.json`). A seed
changes the model initialisation, the SFT example order and the sampling; the held-out prompts
stay fixed.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2                      # AR: exact match
    python benchmarks/quickstart_seeds.py --recipe recipes/diffusion/quickstart.yaml   # toy-GenEval strict

`acc` is the greedy score (AR: greedy decoding; diffusion: the deterministic ODE sampler),
`avg@k` the mean over k sampled answers or images per prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default=str(REPO / "recipes/ar/quickstart.yaml"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unirl-seeds-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    rows = []
    for seed in args.seeds:
        name = f"seed{seed}"
        cmd = [sys.executable, "-m", "flows.cli", "run", args.recipe, f"storage.root={work}", "--run-name", name,
               f"seed={seed}", f"model.tiny.seed={seed}", f"sft.seed={seed}", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        versions = sorted(p.name for p in (work / name / "eval").iterdir())
        before = json.loads((work / name / "eval" / versions[0] / "metrics.json").read_text())["metrics"]
        after = json.loads((work / name / "eval" / versions[-1] / "metrics.json").read_text())["metrics"]
        rows.append((seed, wall, before, after))
    k = next(key for key in rows[0][2] if key.startswith("eval/avg_at_")).rsplit("_", 1)[1]
    print(f"{'seed':>4s} {'wall s':>7s} {'acc SFT':>8s} {'acc RL':>7s} {'gain':>6s} {f'avg@{k} SFT':>10s} {f'avg@{k} RL':>9s}")
    for seed, wall, before, after in rows:
        gain = after["eval/accuracy"] - before["eval/accuracy"]
        print(f"{seed:>4d} {wall:7.0f} {before['eval/accuracy']:8.3f} {after['eval/accuracy']:7.3f} {gain:+6.3f} "
              f"{before[f'eval/avg_at_{k}']:10.3f} {after[f'eval/avg_at_{k}']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

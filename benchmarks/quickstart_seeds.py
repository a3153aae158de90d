"""A quickstart (SFT then RL) for several seeds: wall time and the held-out score after SFT and
after RL, per seed, read from the run's own evaluations (`eval/<version>/metrics.json`). A seed
changes the model initialisation, the SFT example order and the sampling; the held-out prompts
stay fixed.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2                      # AR: exact match
    python benchmarks/quickstart_seeds.py --recipe recipes/diffusion/quickstart.yaml   # toy-GenEval strict
    python benchmarks/quickstart_seeds.py --recipe recipes/video/quickstart.yaml --components  # + per-component means

Each seed's console (per-iteration times) is kept in the work folder as `seed<N>.log`.

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
sys.path.insert(0, str(REPO))


def components(recipe_path: str, overrides: list[str], work: Path, name: str, version: str) -> dict[str, float]:
    """The eval scorer's per-component means over one evaluation's greedy and sampled outputs
    (`greedy/<component>`, `sampled/<component>`): which part of the prompt a model gets wrong."""
    import numpy as np

    from stages.iteration import SCORED_COLUMNS, reads_images, score_batch
    from stages.recipe import load_recipe
    from stages.rewards.base import build_scorer, run_scorer
    from stages.sample import read_rollouts
    from stages.storage import RunStorage

    recipe = load_recipe(recipe_path, overrides)
    scorer_name, params = recipe.eval_scorer()
    storage = RunStorage(str(work), name)
    out = {}
    for kind in ("greedy", "sampled"):
        files = sorted(p.relative_to(work / name).as_posix() for p in (work / name / "eval" / version / kind).rglob("*.arrow"))
        table = read_rollouts(storage, files, columns=SCORED_COLUMNS)
        result = run_scorer(build_scorer(scorer_name, **params), score_batch(table, prompt_images=reads_images([scorer_name])))
        out.update({f"{kind}/{k}": float(np.mean(v)) for k, v in sorted((result.components or {}).items())})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default=str(REPO / "recipes/ar/quickstart.yaml"))
    parser.add_argument("--components", action="store_true",
                        help="also print the eval scorer's per-component means after SFT and after RL")
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
        (work / f"{name}.log").write_text(proc.stdout + proc.stderr)  # the run's console: per-iteration times
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        versions = sorted(p.name for p in (work / name / "eval").iterdir())
        before = json.loads((work / name / "eval" / versions[0] / "metrics.json").read_text())["metrics"]
        after = json.loads((work / name / "eval" / versions[-1] / "metrics.json").read_text())["metrics"]
        rows.append((seed, wall, before, after))
        if args.components:
            common = [f"seed={seed}", *args.overrides]
            for label, version in (("SFT", versions[0]), ("RL", versions[-1])):
                parts = components(args.recipe, common, work, name, version)
                print(f"seed {seed} {label} components: " + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()), flush=True)
    print(f"consoles: {work}/seed<N>.log")
    k = next(key for key in rows[0][2] if key.startswith("eval/avg_at_")).rsplit("_", 1)[1]
    print(f"{'seed':>4s} {'wall s':>7s} {'acc SFT':>8s} {'acc RL':>7s} {'gain':>6s} {f'avg@{k} SFT':>10s} {f'avg@{k} RL':>9s}")
    for seed, wall, before, after in rows:
        gain = after["eval/accuracy"] - before["eval/accuracy"]
        print(f"{seed:>4d} {wall:7.0f} {before['eval/accuracy']:8.3f} {after['eval/accuracy']:7.3f} {gain:+6.3f} "
              f"{before[f'eval/avg_at_{k}']:10.3f} {after[f'eval/avg_at_{k}']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

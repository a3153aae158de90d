"""The vision-language quickstart (SFT then GRPO on toy VQA) for several seeds: wall time, held-out
greedy accuracy after SFT and after RL, and both per question kind, read from the run's own
evaluation shards (`eval/v<version>/greedy/part-*.arrow`); plus how often the greedy answer is
right but for the teacher's stray full stop (what RL has to fix).

    python benchmarks/vlm_quickstart.py --seeds 0 1 2

A seed changes the model initialisation, the SFT example order and the sampling; the held-out
questions and their images stay fixed. Chance per kind (guessing among that kind's answers):
colour 1/4, shape 1/3, count 1/3, position 1/2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pyarrow.ipc as ipc

REPO = Path(__file__).resolve().parents[1]


def greedy_answers(run: Path, version: int) -> list[tuple[str, str, str]]:
    """(kind, answer, response) of every held-out question at policy `version`."""
    out = []
    for part in sorted((run / "eval" / f"v{version:06d}" / "greedy").glob("part-*.arrow")):
        table = ipc.open_file(str(part)).read_all()
        for meta, text in zip(table.column("metadata").to_pylist(), table.column("text").to_pylist()):
            m = json.loads(meta)
            out.append((m["kind"], m["answer"], text))
    return out


def summary(answers: list[tuple[str, str, str]]) -> tuple[float, float, dict[str, float]]:
    """(accuracy, right but for a trailing '.', accuracy per kind)."""
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for kind, answer, text in answers:
        by_kind[kind].append(text.strip() == answer)
    right = sum(t.strip() == a for _, a, t in answers) / len(answers)
    slipped = sum(t.strip() == a + "." for _, a, t in answers) / len(answers)
    return right, slipped, {k: sum(v) / len(v) for k, v in sorted(by_kind.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default=str(REPO / "recipes/vlm/quickstart.yaml"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unirl-vlm-seeds-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    print(f"{'seed':>4s} {'wall s':>7s} {'acc SFT':>8s} {'acc RL':>7s} {'gain':>6s} {'slip SFT':>9s} {'slip RL':>8s}  per kind SFT -> RL")
    for seed in args.seeds:
        name = f"seed{seed}"
        cmd = [sys.executable, "-m", "unirl.flows.cli", "run", args.recipe, f"storage.root={work}", "--run-name", name,
               f"seed={seed}", f"model.tiny.seed={seed}", f"sft.seed={seed}", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        versions = sorted(int(p.name[1:]) for p in (work / name / "eval").iterdir())
        (acc0, slip0, kinds0), (acc1, slip1, kinds1) = (summary(greedy_answers(work / name, v)) for v in (versions[0], versions[-1]))
        kinds = "  ".join(f"{k} {kinds0[k]:.2f}->{kinds1[k]:.2f}" for k in kinds1)
        print(f"{seed:>4d} {wall:7.0f} {acc0:8.3f} {acc1:7.3f} {acc1 - acc0:+6.3f} {slip0:9.3f} {slip1:8.3f}  {kinds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

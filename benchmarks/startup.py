"""What the cyclic garbage collector costs a unirl process's start-up, side by side in one run:

    python benchmarks/startup.py [--repeat 5]

Each round starts a fresh interpreter per case and mode and measures the CPU seconds
(`time.process_time`) to import what that process imports before it works: the flow process
(`unirl.flows.rl`, `mlflow.tracking`) and a worker rank of the qwen3 and of the sd3 family (the worker
and the modules the family has the rank preload: transformers, diffusers, peft). "on" is
Python's default, "off" is what stages/runtime/startup.py does (the collector off until the imports are
done). Medians over the rounds; the modes alternate within a round, so a
busy machine slows both alike.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cases() -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from unirl.stages.models.family import get_family

    out = {"flow process (flows.rl, mlflow.tracking)": "unirl.flows.rl,mlflow.tracking"}
    for kind in ("qwen3", "sd3"):
        out[f"{kind} worker rank"] = ",".join(("unirl.stages.workers.worker", *get_family(kind).modules))
    return out


PROBE = """
import gc, importlib, sys, time
start = time.process_time()
if sys.argv[1] == "off":
    gc.disable()
for module in sys.argv[2].split(","):
    importlib.import_module(module)
gc.enable()
print(time.process_time() - start)
"""


def import_cpu(mode: str, modules: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, modules], cwd=REPO, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| process | GC on (CPU-s) | GC off (CPU-s) | less |\n|---|---|---|---|")
    for label, modules in cases().items():
        got: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.repeat):
            for mode in got:
                got[mode].append(import_cpu(mode, modules))
        on, off = statistics.median(got["on"]), statistics.median(got["off"])
        print(f"| {label} | {on:.2f} | {off:.2f} | {100 * (on - off) / on:.0f}% |", flush=True)


if __name__ == "__main__":
    main()

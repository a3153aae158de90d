"""Seconds per weight version synced into a dedicated engine, its own process: `engine_server`
(unirl's own) and `vllm` (a vLLM server from its own venv), through the same code a run uses
(`engine.sync`): full weights (publish weights/vN: gather, export, sha256 manifest, tensor
checksum, the canary's log-probs; the engine loads the folder and reports its version, the engine
server its checksum too) and LoRA adapters only (adapters/vN, hot-loaded under vN); every load is
verified by the canary (stages/runtime/canary.py), whose check is part of the seconds. Models: a
tiny Qwen3 whose head width vLLM's CPU attention serves (head_dim 32) and a ~0.5B-parameter Qwen3
config (random init saved to disk, the tiny character tokenizer).

    python benchmarks/weight_sync.py                 # both engines, tiny and 0.5B, full and LoRA, 3 versions each
    python benchmarks/weight_sync.py --engines engine_server --sizes tiny
    python benchmarks/weight_sync.py --vllm-python /opt/vllm/bin/python

vLLM's interpreter: --vllm-python, else UNIRL_VLLM_PYTHON, else the suite's venv (tests/vllm_env.py).
Each engine is pinned to the first `--threads` cores this process may use, with that many threads.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES = ("engine_server", "vllm")
SIZES = {
    # vLLM's CPU attention serves head widths of 32 and more (stages/engines/vllm.py CPU_HEAD_DIMS)
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 32, "intermediate_size": 128},
    # 28 layers x (attention 4.2M + MLP 12.6M) = 0.47B parameters (the tiny tokenizer's vocabulary is small)
    "0.5B": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 64, "intermediate_size": 4096, "max_position_embeddings": 64},
}


class LocalTrainer:
    """The worker group's `version` / `ensure` / `call`, served by one in-process worker."""

    def __init__(self, worker: Any):
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.version

    def ensure(self, version: int) -> None:
        self.worker.version = version

    def call(self, cmd: str, **args: Any) -> Any:
        return self.worker.execute(cmd, args)


def vllm_python(given: str | None) -> str:
    """The interpreter of vLLM's own venv: `given`, UNIRL_VLLM_PYTHON, or the suite's install."""
    python = given or os.environ.get("UNIRL_VLLM_PYTHON")
    if python:
        return python
    from tests import vllm_env

    if vllm_env.DONE.exists():
        return str(vllm_env.PYTHON)
    sys.exit(f"vllm: no interpreter of vLLM's venv: pass --vllm-python, set UNIRL_VLLM_PYTHON, or install the suite's "
             f"into {vllm_env.HOME} with `python tests/vllm_env.py` (docs/engines.md); or leave vllm out of --engines")


def pinned_cores(threads: int) -> list[int]:
    """The first `threads` cores this process may run on."""
    cores = sorted(os.sched_getaffinity(0))
    if threads > len(cores):
        sys.exit(f"--threads {threads}: this process may use {len(cores)} cores ({cores})")
    return cores[:threads]


def launch_fields(engine: str, cores: list[int], python: str | None) -> dict[str, Any]:
    """`rollout.engine` fields that put a launched engine on `cores` with one thread per core."""
    if engine == "engine_server":
        return {"threads": len(cores), "cpus": cores}
    if engine == "vllm":  # VLLM_CPU_OMP_THREADS_BIND: one OpenMP thread per listed core
        return {"python": python, "cpus": cores}
    raise ValueError(f"engine {engine!r}: launched engines here are {', '.join(ENGINES)}")


def measure(size: str, weights: str, engine_name: str, versions: int, root: Path, fields: dict[str, Any],
            transport: str) -> dict[str, Any]:
    from unirl.stages.engines.launched import LaunchedEngine
    from unirl.stages.recipe import build_recipe
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.registry import engines
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    lora = {"lora": {"rank": 8}} if weights == "lora" else {}
    recipe = build_recipe({"model": {"kind": "qwen3", "tiny": SIZES[size], **lora}, "storage": {"root": str(root)},
                           "rollout": {"engine": {"name": engine_name, "sync": {"weights": weights, "transport": transport},
                                                  **fields}},
                           "name": f"{engine_name}-{size.replace('.', '')}-{weights}-{transport}"})
    storage = RunStorage(str(root), recipe.name)
    initial_weights(storage, recipe)
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(root), "run": recipe.name,
            "weights_dir": str(storage.local_path(storage.weights_rel(0))), "scratch": str(root / f"scratch-{recipe.name}")}
    worker = Worker(spec, None, torch.device("cpu"))
    params = sum(p.numel() for p in worker.stack.module.parameters())
    engine = engines.get(engine_name)(recipe, storage, None)
    assert isinstance(engine, LaunchedEngine), f"{engine_name} is not an engine the run launches"
    try:
        start = time.perf_counter()
        engine.ensure(0)  # the engine's start is not a sync
        started = time.perf_counter() - start
        times, loads, stages, canary = [], [], [], []
        for version in range(1, versions + 1):
            with torch.no_grad():  # a changed policy each version (its checksum and canary move)
                for p in worker.stack.trainable:
                    p.add_(1e-3)
            worker.version = version
            start = time.perf_counter()
            out = engine.sync(LocalTrainer(worker), version)
            times.append(time.perf_counter() - start)
            loads.append(out["load_s"])
            stages.append(out.get("stage_s", out.get("publish_s", float("nan"))))
            canary.append(out.get("canary_max_abs_diff", float("nan")))
        return {"params": params, "s/version": statistics.median(times), "load": statistics.median(loads),
                "stage": statistics.median(stages),
                "canary": max(canary), "start": started}
    finally:
        engine.close()
        shutil.rmtree(root / recipe.name, ignore_errors=True)  # 1.8 GB a version at 0.5B on disk
        shutil.rmtree(str(spec["scratch"]), ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--weights", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--transports", nargs="+", default=["shm", "disk"], choices=["shm", "disk"],
                        help="shm: staged in shared memory, canary-verified; disk: published weights/vN with manifests")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="cores (and threads) of each engine (default 1)")
    parser.add_argument("--vllm-python", default=None, help="interpreter of vLLM's venv")
    args = parser.parse_args()
    python = vllm_python(args.vllm_python) if "vllm" in args.engines else None
    cores = pinned_cores(args.threads)
    root = Path(tempfile.mkdtemp(prefix="unirl-weight-sync-"))
    print(f"engines pinned to cores {cores}, {len(cores)} thread(s) each; median of {args.versions} versions; "
          "canary: largest |engine - trainer| log-prob over the versions")
    print(f"{'model':6s} {'params':>8s} {'engine':14s} {'weights':8s} {'transport':9s} {'s/version':>10s} "
          f"{'trainer s':>10s} {'engine load s':>14s} {'canary_max_abs_diff':>20s} {'start s':>8s}")
    try:
        for size in args.sizes:
            for weights in args.weights:
                for name in args.engines:
                    for transport in args.transports:
                        m = measure(size, weights, name, args.versions, root, launch_fields(name, cores, python), transport)
                        print(f"{size:6s} {m['params'] / 1e6:7.1f}M {name:14s} {weights:8s} {transport:9s} "
                              f"{m['s/version']:10.3f} {m['stage']:10.3f} {m['load']:14.3f} {m['canary']:20.2e} "
                              f"{m['start']:8.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

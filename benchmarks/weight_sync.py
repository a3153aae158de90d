"""Seconds per weight version synced into a dedicated engine (the engine server, its own process):
full weights (publish weights/vN: gather, export, sha256 manifest, tensor checksum; the engine
verifies the manifest, loads in place and reports version and checksum back) and LoRA adapters
only (adapters/vN, hot-loaded under vN), for the tiny Qwen3 and a ~0.5B-parameter Qwen3 config
(random init saved to disk, the tiny character tokenizer).

    python benchmarks/weight_sync.py                 # tiny and 0.5B, full and LoRA, 3 versions each
    python benchmarks/weight_sync.py --sizes tiny
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128},
    # 28 layers x (attention 4.2M + MLP 12.6M) = 0.47B parameters (the tiny tokenizer's vocabulary is small)
    "0.5B": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 64, "intermediate_size": 4096, "max_position_embeddings": 64},
}


class LocalTrainer:
    """The worker group's `ensure` / `call`, served by one in-process worker."""

    def __init__(self, worker):
        self.worker = worker

    def ensure(self, version: int) -> None:
        self.worker.version = version

    def call(self, cmd: str, **args):
        return self.worker.execute(cmd, args)


def measure(size: str, weights: str, versions: int, root: Path) -> tuple[float, float, int]:
    from unirl.stages.engines.engine_server import EngineServer
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.run import initial_weights
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    lora = {"lora": {"rank": 8}} if weights == "lora" else {}
    recipe = build_recipe({"model": {"kind": "qwen3", "tiny": SIZES[size], **lora}, "storage": {"root": str(root)},
                           "rollout": {"engine": {"name": "engine_server", "sync": {"weights": weights}, "threads": 1}},
                           "name": f"{size.replace('.', '')}-{weights}"})
    storage = RunStorage(str(root), recipe.name)
    initial_weights(storage, recipe)
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(root), "run": recipe.name,
            "weights_dir": str(storage.local_path(storage.weights_rel(0))), "scratch": str(root / f"scratch-{recipe.name}")}
    worker = Worker(spec, None, torch.device("cpu"))
    params = sum(p.numel() for p in worker.stack.module.parameters())
    engine = EngineServer(recipe, storage, None)
    try:
        engine.ensure(0)  # the engine's start is not a sync
        times, loads = [], []
        for version in range(1, versions + 1):
            with torch.no_grad():  # a changed policy each version (its checksum moves)
                for p in worker.stack.trainable:
                    p.add_(1e-3)
            worker.version = version
            start = time.perf_counter()
            out = engine.sync(LocalTrainer(worker), version)
            times.append(time.perf_counter() - start)
            loads.append(out["load_s"])
        return statistics.median(times), statistics.median(loads), params
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--versions", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="unirl-weight-sync-"))
    print(f"{'model':6s} {'params':>8s} {'weights':8s} {'s/version':>10s} {'engine load s':>14s}")
    for size in args.sizes:
        for weights in ("full", "lora"):
            per, load, params = measure(size, weights, args.versions, root)
            print(f"{size:6s} {params / 1e6:7.1f}M {weights:8s} {per:10.3f} {load:14.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

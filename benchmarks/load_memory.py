"""Peak host memory of loading a real-size model into the train stack, whole vs sharded.

    python benchmarks/load_memory.py [--work DIR] [--dtype float32|bfloat16]

A ~0.5B-parameter Qwen3 (Qwen3-0.6B's architecture: 28 layers, hidden 1024, tied embeddings;
random init saved with `save_pretrained`) is loaded the way a worker rank loads it
(`load_bundle` + `TrainStack`): at world size 1 (one full copy), then at world size 2 under
torchrun/gloo with `train.sharded_load` false (every rank loads the whole model, then FSDP2
shards it) and true (meta build, each rank reads only its shards). Each rank reports its peak
RSS (ru_maxrss, after reading every weight once, so weights still mapped from the file count)
and the RSS of the process before loading (imports only). The table prints per
rank and in total, and the total as a multiple of the one-process load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARCH: dict[str, Any] = {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 4096}


def build(folder: Path) -> Path:
    """The random-init model folder (made once; a tokenizer from code, the model from config)."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unirl.stages.runtime.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+-=*() ")
    config = Qwen3Config(**ARCH, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; saving to {folder}", file=sys.stderr)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(folder: Path, sharded: bool, dtype: str) -> None:
    """One rank: load as a worker does and print its peak RSS."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from unirl.stages.models.qwen3 import Qwen3, Qwen3ModelConfig
    from unirl.stages.train.stack import OptimizerSpec, TrainStack, load_bundle

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    before = rss_mib()
    cfg = Qwen3ModelConfig(path=str(folder), dtype=dtype)
    bundle = load_bundle(Qwen3, folder, cfg, "cpu", sharded=sharded and world > 1)
    stack = TrainStack(Qwen3, bundle, mesh=mesh, device=torch.device("cpu"), spec=OptimizerSpec(lr=1e-5), weights_dir=folder)
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in stack.module.parameters()]
    local = sum(t.numel() for t in shards)
    checksum = sum(float(t.float().sum()) for t in shards)  # every weight read once: a lazily mapped file counts too
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": dist.get_rank(), "before_mib": before, "peak_mib": peak, "local_params": local, "checksum": checksum}), flush=True)
    dist.destroy_process_group()


def measure(folder: Path, nproc: int, sharded: bool, dtype: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), __file__, "--child",
           "--work", str(folder), "--dtype", dtype] + (["--sharded"] if sharded else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "unirl-load-memory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.work, args.sharded, args.dtype)
        return 0
    folder = build(args.work)
    size = (folder / "model.safetensors").stat().st_size / 2**20
    cases = [("world size 1, whole", 1, False), ("world size 2, whole per rank", 2, False), ("world size 2, sharded", 2, True)]
    rows = [(name, measure(folder, n, sharded, args.dtype)) for name, n, sharded in cases]
    one = rows[0][1][0]["peak_mib"]
    print(f"Qwen3 {ARCH['num_hidden_layers']} layers, hidden {ARCH['hidden_size']}, {args.dtype}; weights file {size:.0f} MiB")
    print(f"{'load':32s} {'rank peaks MiB':>20s} {'before load':>16s} {'total MiB':>10s} {'x one copy':>10s}")
    for name, ranks in rows:
        total = sum(r["peak_mib"] for r in ranks)
        peaks = " + ".join(f"{r['peak_mib']:.0f}" for r in ranks)
        before = " + ".join(f"{r['before_mib']:.0f}" for r in ranks)
        print(f"{name:32s} {peaks:>20s} {before:>16s} {total:10.0f} {total / one:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

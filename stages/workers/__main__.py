"""Entry point of one worker rank: `torchrun --nproc-per-node N -m stages.workers --spec FILE`.

Rank 0 listens on loopback for JSON commands (token in UNIRL_CONTROL_TOKEN), relays each to
every rank, runs it everywhere, and answers. Any exception ends the group after rank 0 has
answered with the traceback: the next task relaunches it from the latest checkpoint.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from stages.workers.group import die_with_parent

    die_with_parent()  # the torchrun agent's death takes every rank with it
    parser = argparse.ArgumentParser(prog="python -m stages.workers")
    parser.add_argument("--spec", required=True, help="JSON file: recipe, run storage, initial weights, checkpoint")
    parser.add_argument("--preload", default="", help="modules to import while waiting for the spec (comma-separated)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from stages.workers.control import ControlServer, broadcast_json
    from stages.workers.worker import Worker

    for module in filter(None, args.preload.split(",")):
        importlib.import_module(module)
    spec = wait_for_spec(Path(args.spec))

    backend = spec["backend"]
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(max(1, int(spec.get("threads_per_rank", 1))))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    server = None
    try:
        worker = Worker(spec, mesh, device)
        if rank == 0:
            server = ControlServer(os.environ["UNIRL_CONTROL_TOKEN"])
            ready = Path(spec["ready_file"])
            tmp = ready.with_suffix(".tmp")
            tmp.write_text(json.dumps({"port": server.port, "pid": os.getpid(), "version": worker.version, "world_size": world}))
            tmp.replace(ready)
        while True:
            command = server.next_command() if rank == 0 else None
            command = broadcast_json(command, rank=rank, device=device)
            if command["cmd"] == "noop":
                continue
            if command["cmd"] == "shutdown":
                if server:
                    server.reply({"ok": True, "result": {"version": worker.version}})
                break
            try:
                result = worker.execute(command["cmd"], command["args"])
            except Exception:  # noqa: BLE001 - reported to the client, then the group ends
                text = traceback.format_exc()
                print(f"[rank {rank}] command {command['cmd']} failed:\n{text}", file=sys.stderr, flush=True)
                if server:
                    server.reply({"ok": False, "error": text})
                return 1
            if server:
                server.reply({"ok": True, "result": result})
    finally:
        if server:
            server.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def wait_for_spec(path: Path) -> dict:
    """The group is launched before its spec is written (it imports meanwhile: see
    `WorkerGroup.prewarm`); the owner writes it whole, by rename. The owner's death ends the wait
    (this process gets SIGKILL with it)."""
    while not path.exists():
        time.sleep(0.02)
    return json.loads(path.read_text())


if __name__ == "__main__":
    sys.exit(main())

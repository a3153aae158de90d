"""Entry point of one worker rank: `torchrun --nproc-per-node N -m unirl.stages.workers --spec FILE`.

Rank 0 listens for JSON commands (token in UNIRL_CONTROL_TOKEN), relays each to every rank, runs
it everywhere, and answers. Any exception ends the group after rank 0 has answered with the
traceback: the next task relaunches it from the latest checkpoint.

One node: FILE is the spec, rank 0 listens on loopback and says where in a ready file beside it.
Several nodes (stages/workers/rendezvous.py): FILE is this node's pointer to the group in run
storage; the spec comes from there, rank 0 (on whichever node c10d made it) listens on every
interface and publishes its address and every rank's node there, and each rank leaves a word
there on its way out, so the flow can tell a lost node from the ranks that only saw it go.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from unirl.stages.runtime import startup
from unirl.stages.runtime.processes import parent_pid
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers.control import ControlServer, all_gather_json, broadcast_json
from unirl.stages.workers.group import die_with_parent
from unirl.stages.workers.rendezvous import advertised_host, bind_address, group_rel, write_exit


def main(argv: list[str] | None = None) -> int:
    startup.importing()  # until the preloads are in (stages/runtime/startup.py)

    die_with_parent()  # the torchrun agent's death takes every rank with it
    parser = argparse.ArgumentParser(prog="python -m unirl.stages.workers")
    parser.add_argument("--spec", required=True, help="JSON file: recipe, run storage, initial weights, checkpoint")
    parser.add_argument("--preload", default="", help="modules to import while waiting for the spec (comma-separated)")
    args = parser.parse_args(argv)

    import torch  # start-up time: torch loads on first use, not when a recipe is read
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from unirl.stages.workers.worker import make_worker  # start-up time: it loads torch

    for module in filter(None, args.preload.split(",")):
        importlib.import_module(module)
    startup.imports_done()
    spec = wait_for_spec(Path(args.spec))
    group = spec.get("group")  # several nodes: the group's records live in run storage

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
    records = None
    if group:
        records = RunStorage(spec["root"], spec["run"], spec.get("options"))
    try:
        worker = make_worker(spec, mesh, device)
        me = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "node": int(os.environ.get("GROUP_RANK", "0")),
              "host": socket.gethostname(), "pid": os.getpid(), "agent_pid": parent_pid()}
        ranks = all_gather_json(me, device=device) if group else [me]
        if rank == 0:
            server = announce_ready(spec, records, worker, ranks, world)
        while True:
            command = server.next_command() if server is not None else None
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
                leave(records, group, rank, "error", text)
                if server:
                    server.reply({"ok": False, "error": text})
                return 1
            if server:
                server.reply({"ok": True, "result": result})
    except Exception:  # a broken collective while idle, a failed load: the flow reads why
        leave(records, group, rank, "error", traceback.format_exc())
        raise
    finally:
        if server:
            server.close()
    leave(records, group, rank, "shutdown")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def announce_ready(spec: dict, records: Any, worker: Any, ranks: list[dict], world: int) -> Any:
    """Rank 0: open the control channel and say where it is, with every rank's node, host and pid.
    One node: on loopback, in the local ready file. Several: on every interface (the flow may be
    on another host), in the group's ready.json in run storage, at the address the flow reaches."""
    info = {"pid": os.getpid(), "version": worker.version, "world_size": world, "ranks": ranks}
    if records is None:
        server = ControlServer(os.environ["UNIRL_CONTROL_TOKEN"])
        ready = Path(spec["ready_file"])
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(json.dumps({**info, "host": "127.0.0.1", "port": server.port}))
        tmp.replace(ready)
        return server

    server = ControlServer(os.environ["UNIRL_CONTROL_TOKEN"], host=bind_address())
    host = advertised_host(spec["endpoint"])
    records.write_json(group_rel(spec["group"], "ready.json"), {**info, "host": host, "port": server.port})
    return server


def leave(records: Any, group: str | None, rank: int, status: str, error: str = "") -> None:
    """Several nodes: this rank's last word in the group's records (never raises: it is on the way out)."""
    if records is None or group is None:
        return

    try:
        write_exit(records, group, rank, status, error)
    except Exception as exc:  # noqa: BLE001 - storage gone too; the flow names this rank as silent
        print(f"[rank {rank}] could not record its exit: {exc}", file=sys.stderr, flush=True)


def wait_for_spec(path: Path) -> dict:
    """The group is launched before its spec is written (it imports meanwhile: see
    `WorkerGroup.prewarm`); the owner writes it whole, by rename. The owner's death ends the wait
    (this process gets SIGKILL with it). Several nodes: `path` is this node's pointer to the group
    (root, run, options, group, and its own scratch and threads); the spec is read from run
    storage once the flow has written it."""
    while not path.exists():
        time.sleep(0.02)
    spec = json.loads(path.read_text())
    if "group" not in spec:
        return spec

    storage = RunStorage(spec["root"], spec["run"], spec.get("options"))
    rel = group_rel(spec["group"], "spec.json")
    while not storage.exists(rel):
        time.sleep(0.25)
    return {**storage.read_json(rel), **{k: spec[k] for k in ("group", "scratch", "threads_per_rank", "endpoint")}}


if __name__ == "__main__":
    sys.exit(main())

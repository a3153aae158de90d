"""JSON-able objects between the ranks of a process group (lengths, then UTF-8 bytes: nothing is
unpickled): what the train stack and the worker group's control loop tell each other."""
from __future__ import annotations

import json
from typing import Any


def broadcast_json(obj: Any, *, rank: int, device: Any) -> Any:
    """Send a JSON-able object from rank 0 to all ranks (length, then UTF-8 bytes)."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return obj
    if rank == 0:
        payload = json.dumps(obj).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return obj if rank == 0 else json.loads(bytes(buf.cpu().tolist()))


def all_gather_json(obj: Any, *, device: Any) -> list[Any]:
    """Every rank's JSON-able object, in rank order (lengths, then padded UTF-8 bytes)."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return [obj]
    payload = json.dumps(obj).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = max(int(s.item()) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(n.item())].cpu().tolist())) for b, n in zip(bufs, sizes)]

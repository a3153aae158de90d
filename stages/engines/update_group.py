"""The weight-update process group between a trainer and an engine (SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed`): rank 0 is the trainer's rank
0, ranks 1.. the engine's; the trainer broadcasts each full tensor from rank 0 while the engine,
told the names, dtypes and shapes over HTTP, receives them into its weights. nccl on GPUs; gloo
lets the same path run on CPU against the engine server.

The group is built the way SGLang builds its side (a TCP-store rendezvous at
master_address:master_port under a prefix of the group name, then the backend's process group),
so the trainer's half here meets SGLang's half. It is independent of the trainer's own FSDP
group.
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


TIMEOUT = timedelta(minutes=10)
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what the update group carries


def dtype_of(name: str) -> Any:
    """The torch dtype of one of DTYPE_NAMES."""
    import torch  # start-up time: loaded on first use, not when a recipe is read


    return getattr(torch, name)


def init_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
               group_name: str) -> Any:
    """Join the update group (blocks until all `world_size` members have)."""
    # start-up time: torch loads on first use, not when a recipe is read
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,  # type: ignore[arg-type]
                                         timeout=TIMEOUT)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def broadcast(tensors: list[torch.Tensor], group: Any) -> None:
    """Rank 0 sends, every other member receives into `tensors` (in order)."""
    import torch.distributed as dist  # start-up time: torch loads on first use, not when a recipe is read

    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def destroy(group: Any) -> None:
    import torch.distributed as dist  # start-up time: torch loads on first use, not when a recipe is read

    dist.destroy_process_group(group)

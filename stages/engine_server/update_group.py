"""The engine side of the weight-update group (stages/engines/update_group.py): join it as rank
`rank_offset`, then receive each update's tensors (names, dtypes, shapes given over HTTP) by
broadcast from the trainer and copy them into the served weights between batches."""
from __future__ import annotations

from typing import Any

import torch

from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.engines import update_group as ug


class UpdateGroups:
    def __init__(self, core: EngineCore):
        self.core = core
        self.groups: dict[str, Any] = {}

    def init(self, body: dict[str, Any]) -> None:
        name = str(body.get("group_name", "weight_update_group"))
        if name in self.groups:
            raise EngineRequestError(f"update group {name!r} exists already; destroy it first")
        backend = str(body.get("backend", "nccl"))
        if backend == "nccl" and not torch.cuda.is_available():
            raise EngineRequestError("backend nccl needs CUDA; this engine runs on CPU (use backend gloo)")
        self.groups[name] = ug.init_group(backend=backend, master_address=str(body["master_address"]),
                                          master_port=int(body["master_port"]), world_size=int(body["world_size"]),
                                          rank=int(body["rank_offset"]), group_name=name)

    def receive(self, body: dict[str, Any]) -> None:
        name = str(body.get("group_name", "weight_update_group"))
        if name not in self.groups:
            raise EngineRequestError(f"no update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), list(body["shapes"])
        core = self.core
        with core.lock:
            state = core.base_module().state_dict()
            unknown = [n for n in names if n not in state]
            buffers = []
            for n, d, s in zip(names, dtypes, shapes):
                if d not in ug.DTYPES:
                    raise EngineRequestError(f"{n}: dtype {d!r} (served: {', '.join(ug.DTYPES)})")
                buffers.append(torch.empty(s, dtype=ug.DTYPES[d]))
            ug.broadcast(buffers, self.groups[name])  # always receive: the trainer is sending regardless
            if unknown:
                raise EngineRequestError(f"tensors the served model does not have: {unknown[:3]}")
            with torch.no_grad():
                for n, value in zip(names, buffers):
                    if tuple(state[n].shape) != tuple(value.shape):
                        raise EngineRequestError(f"{n}: shape {tuple(value.shape)}, served {tuple(state[n].shape)}")
                    state[n].copy_(value)
            if body.get("weight_version") is not None:
                core.version = str(body["weight_version"])

    def destroy(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            ug.destroy(group)

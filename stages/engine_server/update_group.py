"""The engine side of the weight-update group (stages/engines/update_group.py): join it as rank
`rank_offset`, then receive each update's tensors (names, dtypes, shapes given over HTTP) by
broadcast from the trainer and copy them into the served weights between batches."""
from __future__ import annotations

import math
from typing import Any

import torch

from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.engines import update_group as ug
from unirl.stages.engines.limits import integer, required, shown, text_field, version_text


class UpdateGroups:
    def __init__(self, core: EngineCore):
        self.core = core
        self.groups: dict[str, Any] = {}

    def init(self, body: dict[str, Any]) -> None:
        name = text_field(body.get("group_name", "weight_update_group"), "group_name")
        if name in self.groups:
            raise EngineRequestError(f"update group {name!r} exists already; destroy it first")
        backend = body.get("backend", "nccl")
        if backend not in ("nccl", "gloo"):
            raise EngineRequestError("backend: nccl or gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise EngineRequestError("backend nccl needs CUDA; this engine runs on CPU (use backend gloo)")
        world_size = integer(required(body, "world_size"), "world_size", 2, 1 << 20)
        self.groups[name] = ug.init_group(backend=backend, master_address=text_field(required(body, "master_address"), "master_address"),
                                          master_port=integer(required(body, "master_port"), "master_port", 1, 1 << 16),
                                          world_size=world_size, rank=integer(required(body, "rank_offset"), "rank_offset", 1, world_size),
                                          group_name=name)

    def receive(self, body: dict[str, Any]) -> None:
        name = text_field(body.get("group_name", "weight_update_group"), "group_name")
        if name not in self.groups:
            raise EngineRequestError(f"no update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = (required(body, key) for key in ("names", "dtypes", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise EngineRequestError("names, dtypes and shapes: lists with one entry per tensor")
        for n, d, s in zip(names, dtypes, shapes):
            if not isinstance(n, str) or not isinstance(d, str) or d not in ug.DTYPE_NAMES or not isinstance(s, list):
                raise EngineRequestError(f"tensor {shown(n)}: a name, a dtype ({', '.join(ug.DTYPE_NAMES)}) and a shape are required")
            for size in s:
                integer(size, f"tensor {shown(n)}: shape", 0, 1 << 40)
        version = None if body.get("weight_version") is None else version_text(body["weight_version"], "weight_version")
        core = self.core
        with core.lock:
            state = core.base_module().state_dict()
            unknown = [n for n in names if n not in state]
            # The trainer sends the served model's tensors: more bytes than the model is not an update.
            sent = sum(math.prod(s) * ug.dtype_of(d).itemsize for d, s in zip(dtypes, shapes))
            served = sum(t.numel() * t.element_size() for t in state.values())
            if sent > served:
                raise EngineRequestError(f"an update of {sent} bytes, larger than the served model's {served}: refused "
                                         "before receiving")
            buffers = [torch.empty(s, dtype=ug.dtype_of(d)) for d, s in zip(dtypes, shapes)]
            ug.broadcast(buffers, self.groups[name])  # always receive: the trainer is sending regardless
            if unknown:
                raise EngineRequestError(f"tensors the served model does not have: {unknown[:3]}")
            with torch.no_grad():
                for n, value in zip(names, buffers):
                    if tuple(state[n].shape) != tuple(value.shape):
                        raise EngineRequestError(f"{n}: shape {tuple(value.shape)}, served {tuple(state[n].shape)}")
                    state[n].copy_(value)
            if version is not None:
                core.version = version

    def destroy(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            ug.destroy(group)

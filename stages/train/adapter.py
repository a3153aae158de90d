"""Publishing the LoRA adapters alone, for an engine's LoRA weight sync: `adapters/v{version:06d}/`
holds adapter_model.safetensors and adapter_config.json (the PEFT layout every engine loads:
SGLang's /load_lora_adapter, the engine server's), then manifest.json with the sha256 of every
file and `weights_sha256`, the checksum of the adapter tensors (stages/runtime/weights_checksum.py).
A few MB instead of the whole model per version."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from unirl.stages.runtime.storage import join
from unirl.stages.runtime.weights_checksum import tensors_checksum
from unirl.stages.train.manifests import MANIFEST, write_weights_dir

if TYPE_CHECKING:
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.train.stack import TrainStack


def publish_adapter(stack: TrainStack, storage: RunStorage, scratch: Path, version: int,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every rank gathers the full state (a rank-0-only gather deadlocks under FSDP2); rank 0
    writes the adapter folder (idempotent: a published version is kept)."""
    from peft import PeftModel, get_peft_model_state_dict  # start-up time: peft loads on first use, not when a recipe is read

    start = time.perf_counter()
    if stack.lora is None or not isinstance(stack.module, PeftModel):
        raise ValueError("publishing adapters needs a LoRA policy (model.lora)")
    rel = storage.adapters_rel(version)
    full = get_model_state_dict(stack.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if stack.rank == 0 and not storage.exists(join(rel, MANIFEST)):
        from safetensors.torch import save_file  # start-up time: safetensors loads on first use, not when a recipe is read

        adapter = {k: v.contiguous().clone() for k, v in get_peft_model_state_dict(stack.module, state_dict=full).items()}
        local = scratch / f"adapter-{version:06d}"
        local.mkdir(parents=True, exist_ok=True)
        save_file(adapter, str(local / "adapter_model.safetensors"), metadata={"format": "pt"})
        stack.module.peft_config["default"].save_pretrained(str(local))
        write_weights_dir(storage, local, rel, {"version": version, "kind": "lora", **(extra or {}),
                                                "weights_sha256": tensors_checksum(adapter.items())})
    stack.barrier()
    return {"version": version, "path": rel, "seconds": time.perf_counter() - start}

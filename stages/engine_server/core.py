"""What the engine server holds: its own copy of the policy's weights (loaded from a published
weights folder, never shared with the trainer), the version it samples with, LoRA adapters hot
loaded under their names, and the switches SGLang's API has: pause / continue and release /
resume of memory.

One lock orders sampling and weight changes: a weight update waits for the batch that is being
sampled and the next batch sees only the new weights, so every sample is stamped with exactly
the version that produced it.
"""
from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from unirl.stages.engines.limits import EngineRequestError, shown
from unirl.stages.models.family import get_family
from unirl.stages.runtime.registry import policies
from unirl.stages.runtime.weights_checksum import tensors_checksum
from unirl.stages.train.manifests import MANIFEST, verify_weights_dir
from unirl.stages.train.staging import read_into

log = logging.getLogger("unirl.engine_server")


def verify_folder(path: Path) -> str | None:
    """Check the folder against its sha256 manifest (published weights have one); the manifest's
    own sha256, None without one. A file that does not match is an error naming it."""

    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        verify_weights_dir(path)
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    except (ValueError, OSError) as exc:
        raise EngineRequestError(f"refusing {path}: {exc}") from None
    except (KeyError, TypeError, AttributeError):
        raise EngineRequestError(f"refusing {path}: its {MANIFEST} is not a weights manifest") from None


def client_folder(path: str, field: str, marker: str | None = None) -> Path:
    """The folder a request names (`field`), holding the file `marker` when given. A missing path,
    a file, a folder the engine may not read and a folder without `marker` get one answer that
    repeats only what the client sent, so requests cannot probe what exists on the engine's host."""
    folder = Path(path)
    try:
        found = folder.is_dir() and os.access(folder, os.R_OK | os.X_OK) and (marker is None or (folder / marker).is_file())
    except (OSError, ValueError):  # unreadable parents; a NUL byte in the path
        found = False
    if not found:
        raise unreadable(path, field)
    return folder


def unreadable(path: str, field: str) -> EngineRequestError:
    return EngineRequestError(f"{field} {shown(path, 200)}: no folder the engine can load there (missing, not readable by "
                              "the engine, or not what this route loads)")


class EngineCore:
    """The model of one recipe (`recipe.model`, `recipe.rollout`) loaded from `weights_dir`,
    serving policy version `version`."""

    def __init__(self, recipe: Any, weights_dir: str | Path, version: str, device: str = "cpu"):
        self.recipe = recipe
        self.family = get_family(recipe.model.kind)
        self.policy_cls = policies.get(self.recipe.rollout.kind)
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self.running = threading.Event()
        self.running.set()
        self.model_path, self.version = str(weights_dir), str(version)
        self.adapters: dict[str, str] = {}  # name -> folder
        self.slots: dict[str, str] = {}  # name -> the PEFT adapter holding it
        self.spare: dict[str, dict[str, Any]] = {}  # PEFT adapters no name uses, by their config
        self.configs: dict[str, dict[str, Any]] = {}  # PEFT adapter -> its adapter_config.json
        self.policy: Any = None
        self.released = False
        self._pending: tuple[str, str] | None = None
        self.loads: list[float] = []  # seconds of each weight load
        verify_folder(Path(weights_dir))
        self._build(Path(weights_dir))

    # -- the model --------------------------------------------------------------------------------
    def _build(self, path: Path) -> None:
        bundle = self.family.load(path, self.recipe.model, self.device)
        bundle.module.eval().requires_grad_(False)
        self.policy = self.policy_cls(self.family, bundle, self.recipe, self.device)
        self.adapters, self.slots, self.spare, self.configs = {}, {}, {}, {}  # a plain model: adapters loaded again

    @property
    def bundle(self) -> Any:
        return self.policy.bundle

    @property
    def module(self) -> Any:
        return self.policy.bundle.module

    def base_module(self) -> Any:
        module = self.module
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    def wait_running(self) -> None:
        """Block while generation is paused or the memory released."""
        self.running.wait()

    # -- weights ----------------------------------------------------------------------------------
    def update_from_disk(self, model_path: str, version: str | None) -> dict[str, Any]:
        """Load the published folder `model_path` (checked against its manifest first) in place of
        the current weights, between batches; while released, on resume."""
        path = client_folder(model_path, "model_path")
        digest = verify_folder(path)
        version = str(version) if version is not None else self.version
        with self.lock:
            if self.released:
                self._pending = (model_path, version)
                return {"manifest_sha256": digest, "seconds": 0.0}
            start = time.perf_counter()
            try:
                self._load_into(path)
            except EngineRequestError:
                raise
            except Exception:  # noqa: BLE001 - the cause names server paths: the operator's log has it, the client one answer
                log.exception("loading weights from model_path %r failed", model_path)
                raise unreadable(model_path, "model_path") from None
            self.model_path, self.version = model_path, version
            seconds = time.perf_counter() - start
            self.loads.append(seconds)
        return {"manifest_sha256": digest, "seconds": seconds}

    def _load_into(self, path: Path) -> None:
        """The family's weight files copied into the live module (the base model under any
        adapters); a family without separate weight files is loaded whole again."""
        try:
            files = self.family.weight_files(path)
        except NotImplementedError:
            files = []
        if not files:
            adapters = dict(self.adapters)
            self._build(path)
            for name, folder in adapters.items():
                self.load_adapter(name, folder)
            return
        state = self.base_module().state_dict()
        for file in files:
            try:
                read_into(file, state)
            except ValueError as exc:
                raise EngineRequestError(str(exc)) from None
        if hasattr(self.policy, "prompts"):
            self.policy.prompts._cache.clear()  # conditioning of the old weights' text encoders

    def checksum(self, module_names: list[str] | None) -> dict[str, str]:
        """sha256 of what is loaded (stages/runtime/weights_checksum.py): "model" (the served module's
        weights, under the names of the published files) or a LoRA adapter's name."""
        out = {}
        with self.lock:
            for name in module_names or ["model"]:
                if name == "model":
                    out[name] = tensors_checksum(self.base_module().state_dict().items())
                elif name in self.adapters:
                    from peft import get_peft_model_state_dict  # start-up time: peft loads on first use, not when a recipe is read

                    out[name] = tensors_checksum(get_peft_model_state_dict(self.module, adapter_name=self.slots[name]).items())
                else:
                    raise EngineRequestError(f"no module or adapter named {name!r} (adapters: {sorted(self.adapters)})")
        return out

    # -- LoRA -------------------------------------------------------------------------------------
    def load_adapter(self, name: str, folder: str) -> None:
        """Hot-load the PEFT adapter in `folder` under `name` (a request with lora_path=name uses it).
        An adapter unloaded before with the same adapter_config.json left its layers in place (a
        spare slot): its tensors are overwritten with the new ones instead of adding layers again
        (1.8 s against milliseconds at 0.5B), which is what a weight sync's unload-then-load hits."""
        path = client_folder(folder, "lora_path", marker="adapter_config.json")
        verify_folder(path)
        from peft import PeftModel  # start-up time: peft loads on first use, not when a recipe is read

        with self.lock:
            if name in self.adapters:
                raise EngineRequestError(f"an adapter named {name!r} is loaded already; unload it first")
            try:
                config = json.loads((path / "adapter_config.json").read_bytes()[: 1 << 20])
                slot = next((s for s, c in self.spare.items() if c == config), None)
                if slot is not None:
                    self._fill_slot(slot, path)
                    del self.spare[slot]
                else:
                    slot = f"slot{len(self.slots) + len(self.spare)}-{name}"
                    if isinstance(self.module, PeftModel):
                        self.module.load_adapter(str(path), adapter_name=slot)
                    else:
                        self.bundle.module = PeftModel.from_pretrained(self.module, str(path), adapter_name=slot)
                self.configs[slot] = config
            except EngineRequestError:
                raise
            except Exception:  # noqa: BLE001 - as for weights: the cause in the log, one answer to the client
                log.exception("loading the adapter in lora_path %r failed", folder)
                raise unreadable(folder, "lora_path") from None
            self.module.eval().requires_grad_(False)
            self.adapters[name], self.slots[name] = folder, slot

    def _fill_slot(self, slot: str, path: Path) -> None:
        """The adapter tensors of `path` copied into the layers of adapter `slot` (the same config)."""
        from peft import set_peft_model_state_dict  # start-up time: peft loads on first use, not when a recipe is read

        state: dict[str, torch.Tensor] = {}
        tensors = path / "adapter_model.safetensors"
        from safetensors import safe_open  # start-up time: safetensors loads on first use, not when a recipe is read

        with safe_open(str(tensors), "pt") as fh:
            state = {k: fh.get_tensor(k) for k in fh.keys()}
        result = set_peft_model_state_dict(self.module, state, adapter_name=slot)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{slot}." in k]
        if missing:
            raise EngineRequestError(f"lora_path {shown(str(path), 200)}: adapter tensors missing: {missing[:3]}")

    def unload_adapter(self, name: str) -> None:
        """`name` is no longer served; its layers stay as a spare slot for the next adapter of its
        config (one spare at most: an older one is deleted)."""
        with self.lock:
            if name not in self.adapters:
                raise EngineRequestError(f"no adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
            slot = self.slots.pop(name)
            del self.adapters[name]
            for old in list(self.spare):
                self.module.delete_adapter(old)
                del self.spare[old], self.configs[old]
            self.spare[slot] = self.configs[slot]

    def adapter_scope(self, name: str | None) -> Any:
        """Context in which the module samples with adapter `name` (None: the base weights)."""
        module = self.module
        if name is None:
            return module.disable_adapter() if self.slots or self.spare else nullcontext()
        if name not in self.adapters:
            raise EngineRequestError(f"lora_path {name!r} is not a loaded adapter (loaded: {sorted(self.adapters)})")
        module.set_adapter(self.slots[name])
        return nullcontext()

    # -- scheduling and memory ----------------------------------------------------------------------
    def pause(self) -> None:
        self.running.clear()

    def resume_generation(self) -> None:
        if not self.released:
            self.running.set()

    def release_memory(self) -> None:
        """Drop the weights (the engine keeps only where they are): the trainer gets the memory."""
        with self.lock:
            if self.released:
                return
            self.running.clear()
            self.released = True
            self.policy = None
            gc.collect()

    def resume_memory(self) -> None:
        """Load the weights again: the version loaded while released, else the last one."""
        with self.lock:
            if not self.released:
                return
            path, version = self._pending or (self.model_path, self.version)
            adapters = dict(self.adapters)
            self._build(Path(path))
            for name, folder in adapters.items():
                self.load_adapter(name, folder)
            self.model_path, self.version, self._pending = path, version, None
            self.released = False
            self.running.set()

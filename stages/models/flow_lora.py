"""LoRA on a flow family's transformer(s) through peft: adapters whose disabled state is the
reference policy (no second copy of the weights), and merging them back for export.

A family's trainable module is one diffusers transformer, or several (Wan 2.2's two experts): every
function here takes the list of those transformers (`Family.transformers(module)`)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _layers(models: Sequence[Any]) -> list[tuple[str, Any]]:
    import torch  # start-up time: loaded on first use, not when a recipe is read

    kinds = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)
    return [(n, m) for model in models for n, m in model.named_modules() if isinstance(m, kinds)]


def add_lora(models: Sequence[Any], *, rank: int, alpha: float, target_modules: Sequence[str] | str, what: str,
             dropout: float = 0.0, adapter_name: str = "default") -> list[str]:
    """Put a peft LoRA adapter (B initialised to zero, so the policy starts equal to the base) on
    the layers of `models` named by `target_modules` (a layer matches a target when its name is the
    target or ends with '.' + target). Only adapter weights stay trainable. Returns the adapted
    layers' names. A target matching no layer raises ValueError naming `what` and the layers."""
    from peft import LoraConfig  # start-up time: peft loads on first use, not when a recipe is read

    layers = [n for n, _ in _layers(models)]
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    hit = lambda name, t: name == t or name.endswith("." + t)  # noqa: E731 - peft's matching rule
    missing = [t for t in targets if not any(hit(n, t) for n in layers)]
    if missing or not targets:
        tails = (n.split(".") for n in layers)
        known = sorted({".".join(t[-3:] if t[-1].isdigit() else t[-2:]) for t in tails})
        raise ValueError(f"LoRA target(s) {missing or targets} match no layer of {what}; its layers end in: {', '.join(known)}")
    for model in models:
        mine = [t for t in targets if any(hit(n, t) for n, _ in _layers([model]))]
        model.add_adapter(
            LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=mine, init_lora_weights=True),  # type: ignore[arg-type]
            adapter_name=adapter_name,
        )
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    return [n for n in layers if any(hit(n, t) for t in targets)]


@contextmanager
def reference_policy(models: Sequence[Any], what: str) -> Iterator[None]:
    """Inside the block `models` run with their LoRA adapters disabled: the base model, i.e. the
    reference policy for KL. Nests safely."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # start-up time: peft loads on first use, not when a recipe is read

    lora_layers = [m for model in models for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not lora_layers:
        raise ValueError(
            f"reference_policy needs a LoRA adapter on {what} (call add_lora); "
            "a fully fine-tuned policy needs a separately loaded reference model"
        )
    if lora_layers[0].disable_adapters:
        yield
        return
    for model in models:
        model.disable_adapters()
    try:
        yield
    finally:
        for model in models:
            model.enable_adapters()


def merge_lora(state: dict[str, torch.Tensor], *, rank: int, alpha: float, adapter: str = "default") -> dict[str, torch.Tensor]:
    """peft-layout weights -> plain ones: W = W_base + (alpha / r) * B @ A for every adapted layer
    (`x.base_layer.weight` + `x.lora_A.<adapter>.weight` + `x.lora_B.<adapter>.weight` -> `x.weight`);
    other keys are kept."""

    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            merged = value.float()
            if leaf == "weight":
                a = state[f"{prefix}.lora_A.{adapter}.weight"].float()
                b = state[f"{prefix}.lora_B.{adapter}.weight"].float()
                merged = merged + scale * (b.flatten(1) @ a.flatten(1)).reshape(merged.shape)
            out[f"{prefix}.{leaf}"] = merged.to(value.dtype)
        else:
            out[key] = value
    return out

"""A flow family's checkpoint is a diffusers folder: `model_index.json` naming the pipeline class
and, per component, its library and class; one subfolder per component. This module reads one (the
family a folder belongs to, its components loaded by the classes it names, as diffusers'
`DiffusionPipeline.from_pretrained` does) and writes a trained one back (the trained transformer(s)
and VAE, every other component copied), so a published version is a valid `model.path` and loads
in diffusers' own pipeline."""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.stages.runtime.registry import families
from unirl.stages.train.manifests import MANIFEST

if TYPE_CHECKING:
    import torch


TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"
# What a folder built in code is made for: its image side, frame count and text tokens per prompt
# (diffusers ignores files it does not know; a real checkpoint has none, and its family takes its
# pipeline's defaults).
DEFAULTS_FILE = "unirl_defaults.json"


def write_defaults(root: Path, **values: Any) -> None:
    (Path(root) / DEFAULTS_FILE).write_text(json.dumps(values, sort_keys=True) + "\n")


def folder_defaults(root: Path, pipeline: dict[str, Any]) -> dict[str, Any]:
    """The `pipeline` defaults (image_size, num_frames, text_length), overridden by the folder's DEFAULTS_FILE."""
    path = Path(root) / DEFAULTS_FILE
    return {**pipeline, **(json.loads(path.read_text()) if path.is_file() else {})}


def read_index(root: Path, field: str = "model.path") -> dict[str, Any]:
    """The folder's model_index.json; FileNotFoundError naming `field` when it has none."""
    path = Path(root) / "model_index.json"
    if not path.is_file():
        raise FileNotFoundError(f"{field}: {root} is not a diffusers folder ({path} is missing)")
    return json.loads(path.read_text())


def listed(index: dict[str, Any], name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def component_class(index: dict[str, Any], name: str) -> Any:
    """The class model_index.json names for component `name` (from diffusers or transformers)."""
    library, cls = index[name]
    module = importlib.import_module(library)
    if not hasattr(module, cls):
        raise ValueError(f"model_index.json names {library}.{cls} for {name!r}, which this {library} does not have")
    return getattr(module, cls)


def load_component(root: Path, index: dict[str, Any], name: str, dtype: torch.dtype | None = None) -> Any:
    """Component `name` of the folder, loaded with the class its index names; models in `dtype`."""
    if not listed(index, name):
        raise ValueError(f"{Path(root) / 'model_index.json'} lists no {name!r}, which "
                         f"{'a ' + index['_class_name'] if '_class_name' in index else 'this diffusers'} folder needs here")
    cls = component_class(index, name)
    kwargs: dict[str, Any] = {}
    if dtype is not None and hasattr(cls, "dtype"):
        kwargs["torch_dtype" if index[name][0] == "diffusers" else "dtype"] = dtype
    if not (root / name).is_dir():
        raise FileNotFoundError(f"{root}: model_index.json lists {name!r} but the subfolder {root / name} is missing")
    try:
        return cls.from_pretrained(root / name, **kwargs)
    except (OSError, ValueError) as exc:
        raise OSError(f"could not load {name!r} of {root} from {root / name}: {exc}") from exc


def component_parameters(root: Path, index: dict[str, Any], name: str) -> tuple[Any, int, int]:
    """Component `name` of the folder built from its config on the meta device (no weights read,
    no memory taken; buffers too), its parameters and its buffers' elements (a position table):
    what `unirl validate --memory` counts."""
    from accelerate import init_empty_weights  # start-up time: loaded on first use, not when a recipe is read

    cls = component_class(index, name)
    with init_empty_weights(include_buffers=True):
        if index[name][0] == "diffusers":
            model = cls.from_config(cls.load_config(Path(root) / name))
        else:
            from transformers import AutoConfig  # start-up time: loaded on first use

            model = cls._from_config(AutoConfig.from_pretrained(str(Path(root) / name)))
    if hasattr(model, "tie_weights"):  # as from_pretrained ties them (T5's shared embedding and its encoder's)
        model.tie_weights()
    return model, sum(p.numel() for p in model.parameters()), sum(b.numel() for b in model.buffers())


def config_of(root: Path, name: str) -> dict[str, Any]:
    """A component's config.json (no weights loaded: validate-time checks read these)."""
    path = Path(root) / name / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.path: {root} has no {name}/config.json")
    return json.loads(path.read_text())


def check_pipeline(root: Path, kind: str, pipelines: tuple[str, ...]) -> dict[str, Any]:
    """The folder's index, after checking it is a checkpoint model.kind `kind` loads (its pipeline
    class is one of `pipelines`); else ValueError naming model.path, what the folder is and which
    model.kind loads it."""
    index = read_index(root)
    name = index.get("_class_name", "?")
    if name in pipelines:
        return index
    owner = [k for k, fam in families.items() if name in getattr(fam, "pipelines", ())]
    hint = f"set model.kind: {owner[0]}" if owner else "no model.kind here loads it"
    raise ValueError(f"model.path: {root} is a {name} folder, not one model.kind {kind!r} loads "
                     f"({', '.join(pipelines)}); {hint}, or point model.path at a {kind} checkpoint")


def write_folder(local: Path, *, base_dir: Path, vae: Any, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    """`local` <- a complete diffusers folder: every component of `base_dir` copied, the `vae`
    saved (SFT trains it) and, per trained subfolder in `parts`, its config copied and its
    state dict (plain names, adapters merged) written as safetensors."""
    from safetensors.torch import save_file  # start-up time: safetensors loads on first use, not when a recipe is read

    local.mkdir(parents=True, exist_ok=True)
    index = json.loads((base_dir / "model_index.json").read_text())
    for name, entry in index.items():
        if name in parts or name == "vae" or not isinstance(entry, list) or entry[0] is None:
            continue
        if (base_dir / name).is_dir():
            shutil.copytree(base_dir / name, local / name, dirs_exist_ok=True)
    shutil.copy2(base_dir / "model_index.json", local / "model_index.json")
    if (base_dir / DEFAULTS_FILE).is_file():
        shutil.copy2(base_dir / DEFAULTS_FILE, local / DEFAULTS_FILE)
    vae.save_pretrained(local / "vae")
    # diffusers records where the VAE was loaded from (a run's own weights folder): an exported
    # folder must not depend on the path its run had, or a resumed run's weights would differ.
    config = json.loads((local / "vae" / "config.json").read_text())
    if config.pop("_name_or_path", None) is not None:
        (local / "vae" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, state in parts.items():
        target = local / name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(base_dir / name / "config.json", target / "config.json")
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
        save_file(tensors, str(target / TRANSFORMER_FILE), metadata={"format": "pt"})


def write_index(root: Path, pipeline: str, components: dict[str, tuple[str, str] | None], **extra: Any) -> None:
    """model_index.json of a folder built in code: the pipeline class, each component's (library,
    class) or None for an absent optional one, and pipeline config values (`extra`)."""
    import diffusers  # start-up time: diffusers loads on first use, not when a recipe is read

    index: dict[str, Any] = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__, **extra}
    for name, entry in components.items():
        index[name] = list(entry) if entry is not None else [None, None]
    (Path(root) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


# The components that fix a flow model's latent space and its text conditioning: what a teacher of
# on-policy distillation must share with its student (its transformer is the only part it runs).
LATENT_SPACE = ("vae", "text_encoder", "tokenizer")


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold the same tensors (names, dtypes, values), read lazily."""
    import torch  # start-up time: loaded on first use, not when a recipe is read
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        keys = sorted(fa.keys())
        return keys == sorted(fb.keys()) and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in keys)


def latent_space_differences(student: Path, teacher: Path) -> list[str]:
    """The files of the VAE, text encoders and tokenizers (`LATENT_SPACE`) in which folder
    `teacher` differs from folder `student`: a file one lacks, other tensors (safetensors files,
    equal at once where both folders' weights manifests give one sha256), a JSON file that says
    something else (its `_`-keys, such as `_name_or_path`, aside), or other bytes."""
    def listing(root: Path) -> dict[str, Path]:
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
                if p.is_file() and len(p.relative_to(root).parts) > 1 and p.relative_to(root).parts[0].startswith(LATENT_SPACE)}

    def digests(root: Path) -> dict[str, str]:
        path = root / MANIFEST
        return {k: v["sha256"] for k, v in json.loads(path.read_text())["files"].items()} if path.is_file() else {}

    def plain(path: Path) -> Any:
        data = json.loads(path.read_text())
        return {k: v for k, v in data.items() if not k.startswith("_")} if isinstance(data, dict) else data

    mine, theirs = listing(Path(student)), listing(Path(teacher))
    known_s, known_t = digests(Path(student)), digests(Path(teacher))
    out = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine or name not in theirs:
            out.append(name)
        elif known_s.get(name) is not None and known_s.get(name) == known_t.get(name):
            continue
        elif name.endswith(".safetensors"):
            if not same_tensors(mine[name], theirs[name]):
                out.append(name)
        elif name.endswith(".json"):
            if plain(mine[name]) != plain(theirs[name]):
                out.append(name)
        elif mine[name].read_bytes() != theirs[name].read_bytes():
            out.append(name)
    return out

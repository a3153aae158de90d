"""Generated tokens per second of the rollout engines side by side in one run: `trainside` (the
training worker's own sampler, in this process), `engine_server` (unirl's engine, its own process)
and `vllm` (a vLLM server from its own venv), each sampling the same requests through the code a
run uses (`engine.generate`: read the requests, sample, commit the rows as a shard).

tokens/s = response tokens of one generate / its wall seconds. Each server starts once (its start
is printed, not counted) and serves every geometry; each (engine, geometry) has one warm-up
generate, then `--repeats` timed ones (each its own iteration's prompts and seeds, the same for
every engine); the median is reported with its ratio to trainside's. Geometries, on the AR
quickstart's recipe (recipes/ar/quickstart.yaml) with its tiny Qwen3 at head_dim 32 (2 heads of 32
instead of 4 of 16: vLLM's CPU attention serves 32 and more), max_position_embeddings 256:

    quickstart   16 prompts x 8 samples x 4 new tokens    (the quickstart's iteration)
    big          64 prompts x 8 samples x 128 new tokens
    qwen3-0.6b   16 prompts x 8 samples x 256 new tokens  at Qwen3-0.6B's geometry (benchmarks/released.py):
                 its vocabulary (151,936: the character tokenizer padded with filler tokens), widths and
                 heads, random init saved to disk, `--layers` of its 28 decoder layers (default 4: a
                 step of the whole model takes minutes a generate on 2 cores); run it on its own

Every sample of an iteration goes in one batch (engine_server `max_batch`, vllm `max_concurrent`,
as the trainside sampler does) unless --max-batch says otherwise. This process and every server
it starts are pinned to the first `--threads` cores, one thread per core in each.

    python benchmarks/engines.py                         # both geometries, three engines, 3 repeats
    python benchmarks/engines.py --geometries big --engines engine_server vllm --repeats 5
    python benchmarks/engines.py --smoke                 # tiny geometries, 1 repeat: does it run
    python benchmarks/engines.py --geometries qwen3-0.6b --repeats 1 --layers 4

vLLM's interpreter: --vllm-python, else UNIRL_VLLM_PYTHON, else the suite's venv (tests/vllm_env.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import LocalTrainer, launch_fields, pinned_cores, vllm_python  # noqa: E402

QUICKSTART = REPO / "recipes" / "ar" / "quickstart.yaml"
# The quickstart's tiny Qwen3 (hidden 64, 2 layers, MLP 128) with heads vLLM's CPU attention serves
ARCH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 128, "max_position_embeddings": 256}
ENGINES = ("trainside", "engine_server", "vllm")
BATCH_FIELD = {"engine_server": "max_batch", "vllm": "max_concurrent"}  # samples a server takes together


@dataclass(frozen=True)
class Geometry:
    name: str
    prompts: int
    group: int
    new_tokens: int
    released: str | None = None  # a released model's geometry (benchmarks/released.py) instead of the tiny ARCH

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    def __str__(self) -> str:
        return f"{self.prompts} x {self.group} x {self.new_tokens}"


GEOMETRIES = {"quickstart": Geometry("quickstart", 16, 8, 4), "big": Geometry("big", 64, 8, 128),
              "qwen3-0.6b": Geometry("qwen3-0.6b", 16, 8, 256, "Qwen3-0.6B")}
SMOKE = {"quickstart": Geometry("quickstart", 4, 2, 4), "big": Geometry("big", 4, 2, 16),
         "qwen3-0.6b": Geometry("qwen3-0.6b", 2, 2, 8, "Qwen3-0.6B")}


def released_folder(root: Path, g: Geometry, layers: int) -> Path:
    """A model folder at the released geometry `g.released` with `layers` decoder layers: random
    init (seeded) in safetensors and the character tokenizer padded to its vocabulary."""
    from released import QWEN3, QWEN3_COMMON, qwen3
    from transformers import AutoConfig, Qwen3ForCausalLM

    from unirl.stages.runtime.tokenizer import build_char_tokenizer

    folder = qwen3(root, g.released, num_hidden_layers=layers, torch_dtype="float32")
    torch.manual_seed(0)
    Qwen3ForCausalLM(AutoConfig.from_pretrained(str(folder))).save_pretrained(folder)
    tok = build_char_tokenizer(vocab_size={**QWEN3_COMMON, **QWEN3[g.released]}["vocab_size"])
    tok.save_pretrained(folder)
    return folder


def recipe_for(root: Path, g: Geometry, engine: dict[str, Any]) -> Any:
    """The quickstart recipe at geometry `g` on the head_dim-32 architecture (or the released
    model's folder under `root`), sampling on `engine`."""
    from unirl.stages.recipe import load_recipe

    model = f"model.path={root / g.released}" if g.released else f"model.tiny={json.dumps(ARCH)}"
    return load_recipe(QUICKSTART, ["name=bench", f"storage.root={root}", model, "sft=null",
                                    f"rollout.prompts_per_iteration={g.prompts}", f"rollout.group_size={g.group}",
                                    f"rollout.max_new_tokens={g.new_tokens}", f"rollout.engine={json.dumps(engine)}"])


def write_requests(storage: Any, recipe: Any, g: Geometry, iteration: int) -> str:
    """Iteration `iteration`'s requests at geometry `g`, kept under a name of their own (the
    iteration's own file is written again by the next geometry)."""
    from unirl.stages.run import iteration as it

    written = it.write_requests(storage, recipe, iteration)["files"][0]
    rel = f"bench-requests/{g.name}-{iteration:03d}.arrow"
    storage.write_bytes(rel, storage.read_bytes(written))
    return rel


def timed(engine: Any, requests: list[str], out: str) -> list[tuple[int, float]]:
    """(response tokens, seconds) of each generate after the first (the warm-up)."""
    runs = []
    for iteration, req in enumerate(requests):
        start = time.perf_counter()
        done = engine.generate(req, f"{out}/{iteration:03d}", iteration, 0)
        runs.append((int(done["response_tokens"]), time.perf_counter() - start))
    return runs[1:]


def trainside(recipes: dict[str, Any], storage: Any, root: Path) -> dict[str, Any]:
    """{geometry: the trainside engine over a worker in this process holding that recipe}."""
    from unirl.stages.runtime.registry import engines
    from unirl.stages.workers.worker import Worker

    out = {}
    for name, recipe in recipes.items():
        spec = {"recipe": recipe.model_dump(mode="json"), "root": str(root), "run": storage.run,
                "weights_dir": str(storage.local_path(storage.weights_rel(0))), "scratch": str(root / f"scratch-{name}")}
        out[name] = engines.get("trainside")(recipe, storage, LocalTrainer(Worker(spec, None, torch.device("cpu"))))
    return out


def attach(launcher: Any, recipe: Any, batch: int) -> Any:
    """An engine of `recipe` (its geometry's sampling parameters) on `launcher`'s running server,
    reached at its URL with its token, as a server started by hand is: one start serves every geometry."""
    from unirl.stages.recipe import with_overrides
    from unirl.stages.runtime.registry import engines

    client = launcher.client(0)
    os.environ[launcher.cfg.token_env] = client._http.headers["Authorization"].removeprefix("Bearer ")
    engine = {"name": launcher.name, "url": client.url, BATCH_FIELD[launcher.name]: batch}
    return engines.get(launcher.name)(with_overrides(recipe, [f"rollout.engine={json.dumps(engine)}"]), launcher.storage, None)


def main() -> int:
    from unirl.stages.engines.launched import LaunchedEngine
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.registry import engines
    from unirl.stages.runtime.storage import RunStorage

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per engine and geometry (median)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="cores (one thread each) of this process and of each server (default: all it may use)")
    parser.add_argument("--max-batch", type=int, default=None, help="samples a server takes together (default: "
                        "an iteration's)")
    parser.add_argument("--vllm-python", default=None, help="interpreter of vLLM's venv")
    parser.add_argument("--smoke", action="store_true", help="4 prompts x 2 samples (4 and 16 new tokens), 1 repeat")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of a released geometry (28: Qwen3-0.6B whole)")
    args = parser.parse_args()
    geometries = [(SMOKE if args.smoke else GEOMETRIES)[name] for name in args.geometries]
    if len({g.released for g in geometries}) > 1:
        parser.error("--geometries: a released model's geometry has weights of its own: run it alone")
    repeats = 1 if args.smoke else args.repeats
    python = vllm_python(args.vllm_python) if "vllm" in args.engines else None
    cores = pinned_cores(args.threads)
    os.sched_setaffinity(0, cores)  # the servers started from here inherit it
    torch.set_num_threads(len(cores))
    root = Path(tempfile.mkdtemp(prefix="unirl-engines-"))
    most = args.max_batch or max(g.samples for g in geometries)
    kv_gib = 1
    for g in geometries:
        if g.released:
            folder = released_folder(root, g, args.layers)
            c = json.loads((folder / "config.json").read_text())  # vLLM's KV cache for every sample at once, fp32
            kv_gib = max(kv_gib, 1 + g.samples * (64 + g.new_tokens) * args.layers * 2 * c["num_key_value_heads"]
                         * c["head_dim"] * 4 // 2**30)

    plain = {g.name: recipe_for(root, g, {"name": "trainside"}) for g in geometries}
    storage = RunStorage(str(root), "bench")
    initial_weights(storage, plain[geometries[0].name])  # one architecture and seed: the same weights for all
    requests = {g.name: [write_requests(storage, plain[g.name], g, i) for i in range(repeats + 1)] for g in geometries}

    results: dict[tuple[str, str], list[tuple[int, float]]] = {}
    starts: dict[str, float] = {}
    for name in args.engines:
        if name == "trainside":
            local = trainside(plain, storage, root)
            for g in geometries:
                results[name, g.name] = timed(local[g.name], requests[g.name], f"out/{name}/{g.name}")
            continue
        fields = {"name": name, **launch_fields(name, cores, python), BATCH_FIELD[name]: most,
                  **({"kv_cache_gib": kv_gib} if name == "vllm" else {})}
        launcher = engines.get(name)(recipe_for(root, geometries[0], fields), storage, None)
        assert isinstance(launcher, LaunchedEngine), f"{name} is not an engine the run launches"
        try:
            start = time.perf_counter()
            launcher.client(0)
            starts[name] = time.perf_counter() - start
            for g in geometries:
                engine = attach(launcher, plain[g.name], args.max_batch or g.samples)
                try:
                    results[name, g.name] = timed(engine, requests[g.name], f"out/{name}/{g.name}")
                finally:
                    engine.close()
        finally:
            launcher.close()

    print(f"\n{datetime.date.today()}, `python benchmarks/engines.py {' '.join(sys.argv[1:])}`: {len(cores)} thread(s) on "
          f"cores {cores} for this process and each server; median of {repeats} timed generate(s) after 1 warm-up; "
          + (f"at most {args.max_batch} samples in one batch" if args.max_batch else "every sample of an iteration in one batch")
          + (f"; vLLM {python}" if python else ""))
    print("\n| geometry | prompts x samples x new tokens | engine | tokens/s | x trainside | s/generate | response tokens "
          "| tokens/s of each run |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for g in geometries:
        rate = {name: statistics.median(t / s for t, s in results[name, g.name]) for name in args.engines}
        for name in args.engines:
            runs = results[name, g.name]
            ratio = f"{rate[name] / rate['trainside']:.2f}" if "trainside" in rate else "-"
            print(f"| {g.name} | {g} | {name} | {rate[name]:.0f} | {ratio} | {statistics.median(s for _, s in runs):.3f} "
                  f"| {statistics.median(t for t, _ in runs):.0f} | {', '.join(f'{t / s:.0f}' for t, s in runs)} |")
    if starts:
        print("\nserver start (not in the table): " + ", ".join(f"{n} {s:.1f} s" for n, s in starts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

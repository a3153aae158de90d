"""One-shot check for a borrowed GPU machine: the real worker groups on nccl, and bf16 against fp32
speed, side by side in one run. It runs from the repo root (the wheels in `.whl/`, ignored through
.git/info/exclude, carry what the GPU image lacks: diffusers, pydantic and its parts, typing_extensions):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu.json
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu.json     # the same checks, tiny, on CPU (gloo)

Checks, each independent (one that fails prints its traceback, the others still run, exit code 1):
* env: torch, CUDA, GPU and NCCL versions, and the torch.distributed APIs the workers use.
* worker_sd3, worker_qwen3: the torchrun worker group (`WorkerGroup`, backend nccl on cuda, world size
  1) of a tiny seeded model, driven as tests/stages/test_diffusion_worker.py drives the worker: two
  iterations of generate, score, advantage, train, then save, publish and a relaunch from that
  checkpoint. Wall time per command; the first update's ratio is exactly 1 (the workers raise
  otherwise; ratio_min/max where reported). At world size 1 the workers keep the plain module
  (`unirl.stages.workers.base.shard`), so NCCL runs (the all-reduces of counts and metrics), FSDP2 does not.
* speed_sd3_loop: `unirl.stages.run.loop.InProcessLoop` at model.dtype float32 and bfloat16, a wider
  and deeper transformer than the tiny default on cuda; steady-state seconds per iteration, ratio.
* speed_qwen3_worker: there is no in-process AR loop, so the AR worker group's generate and train
  step at both dtypes (a larger tiny Qwen3 on cuda); steady-state seconds, ratio.
* sglang_client: the SGLang client (stages/engines/client.py) against a running SGLang server at
  $UNIRL_SGLANG_URL (token in $SGLANG_API_KEY; launch: docs/engines.md): /model_info, a batched
  /generate with return_logprob parsed as the text engine parses it, weight_version, pause and
  continue, flush_cache. Skipped (ok, with the reason) where no server is given.
Results print as they come and go to --out as JSON after every check, so a killed run keeps them.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SD3_RECIPE = REPO / "recipes" / "diffusion" / "quickstart.yaml"
AR_RECIPE = REPO / "recipes" / "ar" / "tiny.yaml"

# Geometry per device: tiny on CPU (a test of the script), enough work on cuda to measure the GPU.
SD3_WORKER = ["rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sampler.num_steps=4",
              "train.micro_batch_size=8"]
SD3_SPEED = {
    "cuda": ["model.tiny.image_size=64", "model.tiny.num_layers=8", "model.tiny.num_heads=8", "model.tiny.head_dim=64",
             "rollout.prompts_per_iteration=8", "rollout.group_size=8", "train.micro_batch_size=32"],
    "cpu": ["rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sampler.num_steps=4",
            "train.micro_batch_size=8"],
}
AR_SPEED = {
    "cuda": ["model.tiny.hidden_size=1024", "model.tiny.num_hidden_layers=8", "model.tiny.num_attention_heads=16",
             "model.tiny.num_key_value_heads=8", "model.tiny.head_dim=64", "model.tiny.intermediate_size=3072",
             "rollout.prompts_per_iteration=64", "rollout.group_size=8", "rollout.max_new_tokens=64",
             "train.micro_batch_size=128"],
    "cpu": [],
}


# What stages/workers use of torch.distributed: FSDP2, DCP in the Hugging Face layout, device meshes.
TORCH_API = {
    "torch.distributed.fsdp": ("fully_shard", "FSDPModule"),
    "torch.distributed.checkpoint": ("save", "load", "HuggingFaceStorageReader", "HuggingFaceStorageWriter"),
    "torch.distributed.checkpoint.state_dict": ("get_state_dict", "set_state_dict", "get_model_state_dict",
                                                "StateDictOptions"),
    "torch.distributed.device_mesh": ("init_device_mesh",),
}


class CheckTimeout(RuntimeError):
    """A check ran past --check-timeout."""


def say(line: str) -> None:
    print(f"[gpu_check] {line}", flush=True)


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def recipe_of(path: Path, root: Path, device: str, overrides: list[str]) -> Any:
    from unirl.stages.recipe import load_recipe

    backend = "nccl" if device == "cuda" else "gloo"
    return load_recipe(path, ["sft=null", f"storage.root={root}", f"train.backend={backend}", "train.nproc=1",
                              "train.startup_timeout_s=240", *overrides])


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- env


def check_env(device: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    for name in ("transformers", "diffusers", "peft", "accelerate", "pydantic", "pydantic_core", "numpy", "pyarrow",
                 "safetensors", "tokenizers", "huggingface_hub", "typing_extensions"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        out.update({"gpu": torch.cuda.get_device_name(0),
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                    "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)})
    out["api"] = api = {}
    if device == "cuda" and not torch.cuda.is_available():
        api["torch.cuda"] = "--device cuda, but torch.cuda.is_available() is False"
    for module, names in TORCH_API.items():
        try:
            missing = [n for n in names if not hasattr(importlib.import_module(module), n)]
            api[module] = f"missing {', '.join(missing)}" if missing else "ok"
        except ImportError as exc:
            api[module] = f"{type(exc).__name__}: {exc}"
    if api["torch.distributed.checkpoint"] == "ok":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        takes = "save_distributed" in inspect.signature(HuggingFaceStorageWriter).parameters
        api["HuggingFaceStorageWriter(save_distributed=)"] = "ok" if takes else "no such parameter"
    out["ok"] = all(v == "ok" for v in api.values())  # a missing API fails the check, versions still reported
    return out


# ---------------------------------------------------------------------------- worker groups


@contextmanager
def worker_group(recipe: Any, root: Path) -> Iterator[Any]:
    """A started WorkerGroup on the recipe's tiny seeded model (weights v000000 built first)."""
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.group import WorkerGroup

    storage = RunStorage(recipe.storage.root, "run")
    group: Any = WorkerGroup(recipe, storage, init_weights=initial_weights(storage, recipe), log=lambda line: say(f"  {line}"))
    try:
        start = time.perf_counter()
        group.start(None)
        group.startup_s = time.perf_counter() - start
        yield group
    finally:
        group.stop()  # also kills a group that never became ready


def one_iteration(group: Any, recipe: Any, i: int) -> dict[str, Any]:
    """generate -> score -> advantage -> train of iteration i, as the tasks run it (without Prefect)."""
    from unirl.stages.run import iteration as it

    storage = group.storage
    req = it.write_requests(storage, recipe, i)
    start = time.perf_counter()
    gen = group.call("generate", iteration=i, requests=req["files"][0], out_dir=f"iter-{i:06d}/rollouts")
    gen_s = time.perf_counter() - start
    scored = it.score(storage, recipe, i, gen["files"])
    adv = it.advantages(storage, recipe, i, scored["files"])
    start = time.perf_counter()
    trained = group.call("train", iteration=i, rollouts=gen["files"], advantages=adv["files"][0])
    train_s = time.perf_counter() - start
    return {"generate_s": gen_s, "generate_worker_s": gen["seconds"], "train_s": train_s,
            "train_worker_s": trained["seconds"], "rows": gen["rows"], "metrics": trained["metrics"],
            "policy_version": trained["policy_version"]}


def check_worker(kind: str, device: str, work: Path) -> dict[str, Any]:
    path, overrides = (SD3_RECIPE, SD3_WORKER) if kind == "sd3" else (AR_RECIPE, [])
    recipe = recipe_of(path, work, device, overrides)
    out: dict[str, Any] = {"backend": recipe.train.backend, "world_size": 1}
    with worker_group(recipe, work) as group:
        out["startup_s"] = group.startup_s
        ping = group.call("ping")
        out["world_size"] = ping["world_size"]
        for i in range(2):
            res = one_iteration(group, recipe, i)
            m = res.pop("metrics")
            res.update({k: m[k] for k in ("ratio_min", "ratio_max", "ratio_mean", "approx_kl", "loss", "grad_norm") if k in m})
            out[f"iter{i}"] = res
            ratio = (f"ratio [{m['ratio_min']}, {m['ratio_max']}]" if "ratio_min" in m
                     else f"ratio_mean {m.get('ratio_mean')} (first update checked == 1 by the worker)")
            say(f"  {kind} iter {i}: generate {res['generate_s']:.3f}s  train {res['train_s']:.3f}s  {ratio}  "
                f"approx_kl {m.get('approx_kl')}  grad {m.get('grad_norm', float('nan')):.4g}")
        for cmd in ("save", "publish"):
            start = time.perf_counter()
            group.call(cmd)
            out[f"{cmd}_s"] = time.perf_counter() - start
        start = time.perf_counter()
        group.start(2)  # a relaunch restores the checkpoint just saved (DCP load onto the device)
        out["restart_from_checkpoint_s"] = time.perf_counter() - start
        if group.version != 2:
            raise AssertionError(f"relaunched from checkpoint 2, the group reports policy version {group.version}")
        say(f"  {kind}: startup {out['startup_s']:.1f}s  save {out['save_s']:.3f}s  publish {out['publish_s']:.3f}s  "
            f"restart from checkpoint {out['restart_from_checkpoint_s']:.1f}s")
    return out


# ---------------------------------------------------------------------------- speed, diffusion


def speedups(out: dict[str, Any], what: str, timings: dict[str, tuple[str, str]]) -> None:
    """out["fp32_over_bf16<suffix>"] = float32 seconds / bfloat16 seconds of each timing
    (label -> (suffix, key)), and one line of them."""
    for suffix, key in timings.values():
        out[f"fp32_over_bf16{suffix}"] = out["float32"][key] / out["bfloat16"][key]
    say(f"  {what} fp32/bf16: " + ", ".join(f"{label} {out[f'fp32_over_bf16{suffix}']:.2f}x"
                                            for label, (suffix, _) in timings.items()))


def time_loop(recipe: Any, weights: str, device: str, dtype: str, warmup: int, timed: int) -> dict[str, Any]:
    import torch

    from unirl.stages.algorithms import BehaviourMismatchError
    from unirl.stages.run.loop import InProcessLoop

    with ExitStack():
        loop = InProcessLoop(recipe, weights, device=device)  # at recipe.model.dtype
        module = loop.worker.stack.module
        param = next(module.parameters())
        if param.dtype != getattr(torch, dtype) or param.device.type != device:
            raise AssertionError(f"loop model is {param.dtype} on {param.device}, wanted {dtype} on {device}")
        out: dict[str, Any] = {"transformer_params": sum(p.numel() for p in module.parameters())}
        times: list[float] = []
        phases: dict[str, list[float]] = {"generate_s": [], "score_s": [], "train_s": []}
        for i in range(warmup + timed):
            sync(device)
            start = time.perf_counter()
            try:
                m = loop.iteration(i)
            except BehaviourMismatchError as exc:
                # Reported; the timing goes on with the check off, the speed is still worth having from a one-shot run.
                out["on_policy_error"] = str(exc)
                say(f"  {dtype}: {exc}; timing goes on with the behaviour check off")
                loop.worker.stack.optimizer.zero_grad(set_to_none=True)
                loop.worker.tolerance = float("inf")
                sync(device)
                start = time.perf_counter()
                m = loop.iteration(i)
            sync(device)
            elapsed = time.perf_counter() - start
            if i == 0:
                out["first_iteration_s"] = elapsed
                out.update({k: m[f"train/{k}"] for k in ("ratio_min", "ratio_max") if f"train/{k}" in m})
            if i >= warmup:
                times.append(elapsed)
                for k in phases:
                    phases[k].append(m[f"time/{k}"])
    out.update({"iteration_s": median(times), "iterations_s": times, **{k: median(v) for k, v in phases.items()}})
    if device == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del loop
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def check_speed_sd3(device: str, work: Path, warmup: int, timed: int) -> dict[str, Any]:
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.storage import RunStorage

    out: dict[str, Any] = {"overrides": SD3_SPEED[device], "warmup": warmup, "timed": timed}
    weights = None
    for dtype in ("float32", "bfloat16"):
        recipe = recipe_of(SD3_RECIPE, work, device, ["reward.scorers=[{name: brightness}]", f"model.dtype={dtype}",
                                                      f"iterations={warmup + timed}", *SD3_SPEED[device]])
        if weights is None:
            storage = RunStorage(recipe.storage.root, "run")
            weights = str(storage.local_path(initial_weights(storage, recipe)))
        res = out[dtype] = time_loop(recipe, weights, device, dtype, warmup, timed)
        say(f"  sd3 loop {dtype}: {res['iteration_s']:.3f} s/iter (generate {res['generate_s']:.3f}, score "
            f"{res['score_s']:.3f}, train {res['train_s']:.3f}); first iteration {res['first_iteration_s']:.2f}s")
    speedups(out, "sd3 loop", {"per iteration": ("", "iteration_s"), "train": ("_train", "train_s")})
    return out


# ---------------------------------------------------------------------------- speed, AR


def check_speed_ar(device: str, work: Path, warmup: int, timed: int) -> dict[str, Any]:
    out: dict[str, Any] = {"overrides": AR_SPEED[device], "warmup": warmup, "timed": timed}
    for dtype in ("float32", "bfloat16"):
        recipe = recipe_of(AR_RECIPE, work / dtype, device, [f"model.dtype={dtype}", f"iterations={warmup + timed}",
                                                             *AR_SPEED[device]])
        with worker_group(recipe, work / dtype) as group:
            rows = [one_iteration(group, recipe, i) for i in range(warmup + timed)][warmup:]
            res = out[dtype] = {
                "startup_s": group.startup_s,
                **{k: median([r[k] for r in rows]) for k in ("generate_s", "generate_worker_s", "train_s", "train_worker_s")},
                "train_s_each": [r["train_s"] for r in rows],
                "samples": rows[-1]["rows"],
            }
        say(f"  qwen3 worker {dtype}: train {res['train_s']:.3f}s (worker {res['train_worker_s']:.3f}s), generate "
            f"{res['generate_s']:.3f}s; startup {res['startup_s']:.1f}s")
    speedups(out, "qwen3 worker", {"train": ("_train", "train_s"), "generate": ("_generate", "generate_s")})
    return out


# ---------------------------------------------------------------------------- driver


def check_sglang_client(url: str | None = None, token: str | None = None) -> dict[str, Any]:
    """The SGLang client against a live SGLang server (see the module docstring)."""
    from unirl.stages.engines.client import EngineClient, finish_reason

    url = url or os.environ.get("UNIRL_SGLANG_URL")
    if not url:
        return {"skipped": "no SGLang server: set UNIRL_SGLANG_URL (docs/engines.md has the launch command)"}
    client = EngineClient(url, token or os.environ.get("SGLANG_API_KEY") or None, name="SGLang server")
    info = client.model_info()
    start = time.perf_counter()
    outs = client.generate([[1, 2, 3], [4, 5]], [{"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 0}] * 2)
    seconds = time.perf_counter() - start
    for out in outs:
        pairs = out["meta_info"]["output_token_logprobs"]
        assert len(pairs) == out["meta_info"]["completion_tokens"], "one log-prob per generated token"
        assert all(p[0] <= 0.0 for p in pairs), "log-probs are <= 0"
        finish_reason(out["meta_info"], url)
    assert outs[0]["meta_info"]["weight_version"] == info["weight_version"]
    client.pause_generation("in_place")
    client.continue_generation()
    client.flush_cache()
    return {"model_path": info.get("model_path"), "weight_version": info.get("weight_version"), "generate_s": seconds,
            "tokens": [len(o["output_ids"]) for o in outs]}


def run_check(name: str, fn: Callable[[], dict[str, Any]], results: dict[str, Any], timeout_s: int) -> None:
    say(f"{name} ...")

    def expire(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"{name} ran past {timeout_s}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    start = time.perf_counter()
    try:
        results["checks"][name] = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - a failed check is reported and the others still run
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        results["checks"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000], "traceback": text[-8000:]}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    results["checks"][name]["seconds"] = time.perf_counter() - start
    say(f"{name}: {'ok' if results['checks'][name]['ok'] else 'FAILED'} ({results['checks'][name]['seconds']:.1f}s)")


def write(results: dict[str, Any], path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, help="JSON file of the results (written after every check)")
    parser.add_argument("--warmup", type=int, help="untimed iterations of the speed checks (cuda 2, cpu 1)")
    parser.add_argument("--timed", type=int, help="timed iterations of the speed checks (cuda 5, cpu 2)")
    parser.add_argument("--check-timeout", type=int, default=300, help="seconds one check may take")
    parser.add_argument("--only", nargs="*", help="run only these checks (env always runs)")
    args = parser.parse_args(argv)
    # The worker ranks (torchrun subprocesses) import stages too, whatever the working directory.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), str(REPO)] if p)
    sys.path.insert(0, str(REPO))
    device = args.device
    warmup = args.warmup if args.warmup is not None else (2 if device == "cuda" else 1)
    timed = args.timed if args.timed is not None else (5 if device == "cuda" else 2)
    work = Path(tempfile.mkdtemp(prefix="unirl-gpu-check-"))
    results: dict[str, Any] = {"device": device, "argv": sys.argv, "checks": {}}
    begin = time.perf_counter()
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("env", lambda: check_env(device)),
        ("worker_sd3", lambda: check_worker("sd3", device, work / "worker_sd3")),
        ("worker_qwen3", lambda: check_worker("qwen3", device, work / "worker_qwen3")),
        ("speed_sd3_loop", lambda: check_speed_sd3(device, work / "speed_sd3", warmup, timed)),
        ("speed_qwen3_worker", lambda: check_speed_ar(device, work / "speed_qwen3", warmup, timed)),
        ("sglang_client", lambda: check_sglang_client()),
    ]
    try:
        for name, fn in checks:
            if name != "env" and args.only and name not in args.only:
                continue
            run_check(name, fn, results, args.check_timeout)
            if name == "env":
                env = results["checks"]["env"]
                say(f"torch {env.get('torch')}  cuda {env.get('torch_cuda')}  gpu {env.get('gpu')}  nccl {env.get('nccl')}  "
                    f"transformers {env.get('transformers')}  diffusers {env.get('diffusers')}  python {env.get('python')}")
                for api, state in env.get("api", {}).items():
                    if state != "ok":
                        say(f"  {api}: {state}")
            write(results, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, c in results["checks"].items() if not c["ok"]]
    results.update({"failed": failed, "total_s": time.perf_counter() - begin})
    write(results, args.out)
    say(f"done in {results['total_s']:.1f}s: {len(results['checks']) - len(failed)} ok, "
        f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

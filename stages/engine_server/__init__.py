"""unirl's own rollout engine: a process of its own with its own copy of the policy's weights,
serving the subset of SGLang's HTTP API that unirl's client uses (stages/engine_server/app.py),
backed by transformers (text) and diffusers (flow models) through the policies' own sampling
code. Started by the `engine_server` rollout engine (stages/engines/engine_server.py) or by hand:

    UNIRL_ENGINE_TOKEN=... unirl engine-server RECIPE [key=value ...] [--weights DIR] [--port 30000]
    python -m unirl.stages.engine_server --spec FILE     # as the rollout engine launches it

It binds loopback by default and requires a bearer token (the variable `--token-env` names).
What one request may ask (body bytes, prompts, tokens, steps, requests in flight) is bounded by the
`--max-*` settings (stages/engines/limits.py; the spec takes the same names).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from unirl.stages.engines.limits import Limits
from unirl.stages.models.family import get_family
from unirl.stages.recipe import RecipeError, build_recipe, load_recipe
from unirl.stages.runtime.processes import die_with_parent
from unirl.stages.runtime.scratch import scratch_dir
from unirl.stages.runtime.secrets import RedactingFilter

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def engine_device(name: str, cuda_devices: int) -> str:
    """The torch device an engine serves on: `name` as given (`cpu`, `cuda`, `cuda:N`), `auto` the
    first CUDA device where there is one, else the CPU. A CUDA device that is not there is an error
    naming what to set."""
    if name == "auto":
        return "cuda:0" if cuda_devices else "cpu"
    if name == "cpu":
        return name
    index = int(name.partition(":")[2] or 0) if name.startswith("cuda") and name[4:5] in ("", ":") else None
    if index is None or (name[5:] and not name[5:].isdigit()):
        raise ValueError(f"engine device {name!r}: use auto, cpu, cuda or cuda:N")
    if index >= cuda_devices:
        raise ValueError(f"engine device {name!r}: torch sees {cuda_devices} CUDA device(s) here; set the engine's device "
                         "to cpu or auto, or run the engine where that GPU is (CUDA_VISIBLE_DEVICES)")
    return f"cuda:{index}"


def serve(recipe: Any, weights: str, version: str, *, host: str, port: int, token: str | None, max_batch: int,
          batch_wait_ms: float, threads: int, limits: Limits, ready_file: str | None = None, log_level: str = "warning",
          device: str = "auto") -> None:
    """Load the model on `device` (`engine_device`) and serve until stopped. `port` 0 takes a free
    one; `ready_file` gets {"port", "pid"} once the server accepts connections."""
    import torch  # start-up time: torch loads on first use, not when a recipe is read
    import uvicorn  # start-up time: uvicorn loads on first use, not when a recipe is read

    from unirl.stages.engine_server.app import create_app  # start-up time: it loads torch
    from unirl.stages.engine_server.core import EngineCore

    torch.set_num_threads(max(1, threads))
    where = engine_device(device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    core = EngineCore(recipe, weights, version, device=where)
    app = create_app(core, token, max_batch=max_batch, batch_wait_s=batch_wait_ms / 1000.0, limits=limits)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    logging.getLogger("uvicorn.access").addFilter(RedactingFilter())
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))

    def announce() -> None:
        while not server.started:
            time.sleep(0.02)
        if ready_file:
            tmp = Path(ready_file).with_suffix(".tmp")
            tmp.write_text(json.dumps({"port": bound, "pid": os.getpid()}))
            tmp.replace(ready_file)
        print(f"[unirl] engine server on http://{host}:{bound} serving {recipe.model.kind} weights {weights} "
              f"(version {version}, on {where}, {threads} CPU thread(s))", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])


LIMIT_HELP = {"max_request_bytes": "request body bytes at most (413 past it)",
              "max_prompts": "prompts in one /generate at most",
              "max_new_tokens": "max_new_tokens of a prompt at most (prompt + max_new_tokens must also fit the model's context)",
              "max_steps": "num_inference_steps of a flow request at most",
              "max_concurrent": "generation requests in flight at most (503 past it), and apart from them other requests"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unirl engine-server", description="Serve a recipe's policy as a rollout engine.")
    p.add_argument("recipe", nargs="?", help="recipe YAML file (its model and rollout sections)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--spec", help="JSON launch spec (how the engine_server rollout engine starts it)")
    p.add_argument("--weights", help="weights folder to serve (default: the recipe's model, materialized)")
    p.add_argument("--version", default="0", help="the policy version those weights are (reported as weight_version)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--token-env", default="UNIRL_ENGINE_TOKEN", help="variable holding the bearer token")
    p.add_argument("--no-auth", action="store_true", help="serve without a token (loopback only)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="auto", help="auto (the first GPU where there is one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--max-batch", type=int, default=64, help="requests (text) or outputs (flow) sampled together at most")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    for f in fields(Limits):
        p.add_argument(Limits.flag(f.name), type=int, default=f.default, help=f"{LIMIT_HELP[f.name]} (default %(default)s)")
    return p


def limits_from(values: dict[str, Any]) -> Limits:
    """Limits from the parsed flags or a launch spec (a missing key keeps its default); each at least 1."""
    chosen = {f.name: int(values.get(f.name, f.default)) for f in fields(Limits)}
    for name, value in chosen.items():
        if value < 1:
            raise ValueError(f"{Limits.flag(name)} {value}: at least 1")
    return Limits(**chosen)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.spec:
        die_with_parent()
        spec = json.loads(Path(args.spec).read_text())
        if spec.get("cpus"):
            os.sched_setaffinity(0, set(spec["cpus"]))
        serve(build_recipe(spec["recipe"]), spec["weights"], str(spec["version"]), host=spec.get("host", "127.0.0.1"),
              port=int(spec.get("port", 0)), token=os.environ.get("UNIRL_ENGINE_TOKEN") or None,
              max_batch=int(spec["max_batch"]), batch_wait_ms=float(spec["batch_wait_ms"]), threads=int(spec["threads"]),
              limits=limits_from(spec), ready_file=spec.get("ready_file"), device=spec.get("device", "auto"))
        return 0
    if not args.recipe:
        print("unirl engine-server: give a recipe (or --spec)", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        limits = limits_from(vars(args))
    except ValueError as exc:
        print(f"unirl engine-server: {exc}", file=sys.stderr)
        return 2
    token = None if args.no_auth else os.environ.get(args.token_env, "")
    if token == "":
        print(f"unirl engine-server: ${args.token_env} is empty: export a token there (clients send it as a bearer "
              "token), or pass --no-auth on a loopback host", file=sys.stderr)
        return 2
    if token is None and args.host not in LOOPBACK:
        print(f"unirl engine-server: --no-auth with --host {args.host}: anyone who reaches it could drive the engine; "
              "serve loopback only without a token", file=sys.stderr)
        return 2
    weights = args.weights
    if weights is None:
        weights = str(get_family(recipe.model.kind).materialize(recipe.model, scratch_dir("unirl-engine-") / "model"))
    try:
        serve(recipe, weights, args.version, host=args.host, port=args.port, token=token, max_batch=args.max_batch,
              batch_wait_ms=args.batch_wait_ms, threads=args.threads, limits=limits, device=args.device)
    except KeyboardInterrupt:
        pass
    except ValueError as exc:  # a device that is not there
        print(f"unirl engine-server: {exc}", file=sys.stderr)
        return 2
    return 0

"""`engine_server`: unirl's own dedicated engine (stages/engine_server/), its own process with its
own copy of the weights, reached over the SGLang-compatible HTTP API. With `url` empty unirl
launches it on loopback (a fresh token per launch, the process pinned to `cpus`), restarts it if
it dies, and stops it with the run; with `url` set it is a server started by hand
(`unirl engine-server`).

Because it runs the policies' own sampling code on the trainer's kinds of devices, rows it samples
with the trained weights replay to their record within the policy's tolerance (text) or bit for
bit (flow: it batches each trainer micro-batch together), so the on-policy check holds as for
trainside.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any, Literal

from pydantic import Field

from unirl.stages.engines import engines
from unirl.stages.engines.client import EngineClient, EngineUnreachable
from unirl.stages.engines.dedicated import DedicatedConfig, DedicatedEngine


def run_limits(recipe: Any) -> dict[str, int]:
    """The engine server's request limits (stages/engine_server/limits.py) raised where a run asks
    for more than their defaults, for its launch spec: a run's own requests are never refused."""
    from unirl.stages.engine_server.limits import Limits

    rollout, default = recipe.rollout, Limits()
    out = {}
    if getattr(rollout, "max_new_tokens", 0) > default.max_new_tokens:
        out["max_new_tokens"] = rollout.max_new_tokens
    sampler = getattr(rollout, "sampler", None)
    if sampler is not None and sampler.num_steps > default.max_steps:
        out["max_steps"] = sampler.num_steps
    return out


class EngineServerConfig(DedicatedConfig):
    """unirl's own engine process (transformers / diffusers), launched by the run or at `url`."""

    name: Literal["engine_server"] = Field("engine_server", description="Rollout engine.")
    url: str | None = Field(None, description="http://host:port of a running `unirl engine-server`; empty: the run "
                            "launches one on loopback and stops it at the end.")
    threads: int = Field(1, ge=1, description="CPU threads of a launched engine.")
    cpus: list[int] = Field(default_factory=list, description="CPU cores a launched engine is pinned to (empty: not pinned).")
    max_batch: int = Field(64, ge=1, description="Requests the engine samples together at most.")
    batch_wait_ms: float = Field(5.0, ge=0, description="How long the engine waits for requests to join a batch.")
    startup_timeout_s: float = Field(180.0, gt=0, description="How long a launched engine may take to load.")
    restarts: int = Field(1, ge=0, description="Times a launched engine that died is started again in one run.")


@engines.register("engine_server")
class EngineServer(DedicatedEngine):
    name = "engine_server"
    config = EngineServerConfig
    exact_replay = True
    reports_checksum = True

    def __init__(self, recipe: Any, storage: Any, group: Any):
        super().__init__(recipe, storage, group)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path = self.scratch / "engine.log"

    def client(self, version: int) -> EngineClient:
        if self.cfg.url is not None:
            if self._client is None:
                token = os.environ.get(self.cfg.token_env) or None
                self._client = EngineClient(self.cfg.url, token, timeout_s=self.cfg.request_timeout_s)
                self._client.model_info()  # unreachable: a clear error naming the URL, before any work
            return self._client
        if self.proc is None or self.proc.poll() is not None:
            self._launch(version)
        assert self._client is not None, "a launched engine has its client"
        return self._client

    def alive(self) -> bool:
        return self.cfg.url is not None or (self.proc is not None and self.proc.poll() is None)

    def _launch(self, version: int) -> None:
        """Start `python -m unirl.stages.engine_server` serving weights/v{version} (or the initial weights
        and then the adapters of `version`)."""
        from unirl.stages.workers.group import kill_tree, spawn

        if self.proc is not None:
            if self.starts > self.cfg.restarts:
                raise EngineUnreachable(f"rollout engine died {self.starts} times (rollout.engine.restarts "
                                        f"{self.cfg.restarts}); its log:\n{self.log_tail()}")
            kill_tree(self.proc)
            self.log(f"rollout engine (pid {self.proc.pid}) exited with {self.proc.returncode}; starting it again")
        DedicatedEngine.close(self)  # the old client; the process is gone
        base = 0 if self.cfg.sync.weights == "lora" else version
        token = secrets.token_hex(16)
        ready = self.scratch / "engine-ready.json"
        ready.unlink(missing_ok=True)
        spec = {"recipe": self.recipe.model_dump(mode="json"), "weights": str(self.local(self.storage.weights_rel(base))),
                "version": base, "host": "127.0.0.1", "port": 0, "ready_file": str(ready), "max_batch": self.cfg.max_batch,
                "batch_wait_ms": self.cfg.batch_wait_ms, "threads": self.cfg.threads, "cpus": list(self.cfg.cpus),
                **run_limits(self.recipe)}
        spec_path = self.scratch / "engine-spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "UNIRL_ENGINE_TOKEN": token, "OMP_NUM_THREADS": str(self.cfg.threads),
               "UNIRL_OWNER_PID": str(os.getpid())}
        if self.starts:  # a fault injected into the engine (UNIRL_FAULTS=engine-generate) hits its first start only
            env.pop("UNIRL_FAULTS", None)
        with open(self.log_path, "ab") as logf:
            self.proc = spawn([sys.executable, "-m", "unirl.stages.engine_server", "--spec", str(spec_path)], env=env,
                              stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise EngineUnreachable(f"rollout engine exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                kill_tree(self.proc)
                raise EngineUnreachable(f"rollout engine not ready after {self.cfg.startup_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        self._client = EngineClient(f"http://127.0.0.1:{port}", token, timeout_s=self.cfg.request_timeout_s)
        self._version, self.lora_name = (base if base == version else None), None

    def log(self, message: str) -> None:
        print(f"[unirl] {message}", file=sys.stderr, flush=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "") -> dict[str, Any]:
        """As DedicatedEngine.generate; a launched engine that died mid-generate is named, started
        again from the published weights and asked again (nothing was committed), up to `restarts`."""
        while True:
            try:
                return super().generate(requests, out_dir, iteration, policy_version, greedy=greedy, seed_tag=seed_tag)
            except EngineUnreachable as exc:
                if self.cfg.url is None and self.proc is not None:
                    try:
                        self.proc.wait(timeout=10)  # a dying process closes its sockets before it is reaped
                    except subprocess.TimeoutExpired:
                        pass
                if self.cfg.url is not None or self.alive() or self.starts > self.cfg.restarts:
                    raise EngineUnreachable(f"{exc}; engine pid {self.proc.pid if self.proc else '-'}, log:\n{self.log_tail()}") from None
                self.log(f"rollout engine died during generate of iteration {iteration} ({exc}); restarting it")
                self._version = None

    def close(self) -> None:
        """Stop a launched engine process (a server at `url` is left running)."""
        from unirl.stages.workers.group import kill_tree

        super().close()
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc = None

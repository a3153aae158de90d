"""A dedicated engine that the run may launch itself: with `url` empty the run starts the
engine's server process on loopback (a fresh token per launch), waits until it is ready, restarts
it if it dies (`restarts` times in one run) and stops it at the end; with `url` set it is a server
started by hand. `engine_server` (unirl's own engine) and `vllm` (a vLLM server from its own
Python environment) are such engines; each says how its server starts (`launch_command`) and how
it is known to be ready (`ready_url`).
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from abc import abstractmethod
from pathlib import Path
from typing import Any

from pydantic import Field

from unirl.stages.engines.client import EngineClient, EngineUnreachable
from unirl.stages.engines.dedicated import DedicatedConfig, DedicatedEngine
from unirl.stages.runtime.processes import kill_tree, spawn
from unirl.stages.runtime.scratch import log_tail
from unirl.stages.train.manifests import MANIFEST


class LaunchedConfig(DedicatedConfig):
    """Fields of an engine the run can launch."""

    url: str | None = Field(None, description="http://host:port of a running server; empty: the run launches one on "
                            "loopback and stops it at the end.")
    startup_timeout_s: float = Field(180.0, gt=0, description="How long a launched engine may take to start.")
    restarts: int = Field(1, ge=0, description="Times a launched engine that died is started again in one run.")


class LaunchedEngine(DedicatedEngine):
    """The process side of an engine the run launches (the client side is DedicatedEngine's)."""

    server_name = "rollout engine"

    def __init__(self, recipe: Any, storage: Any, group: Any):
        super().__init__(recipe, storage, group)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path = self.scratch / "engine.log"

    @property
    def launched_here(self) -> bool:
        return self.proc is not None

    # -- what each engine says ---------------------------------------------------------------------
    @abstractmethod
    def launch_command(self, weights: Path, version: int, token: str) -> tuple[list[str], dict[str, str]]:
        """The server's command line and the variables it adds to the environment."""

    @abstractmethod
    def ready_url(self, client_token: str) -> str | None:
        """The server's URL once it is ready to serve, else None (polled while it starts)."""

    def after_launch(self, client: EngineClient, version: int) -> None:
        """What a launched server needs before it serves weights/v{version} as that version."""

    def make_client(self, url: str, token: str | None) -> EngineClient:
        return EngineClient(url, token, timeout_s=self.cfg.request_timeout_s, name=self.server_name)

    # -- where the engine is ------------------------------------------------------------------------
    def client(self, version: int) -> EngineClient:
        if self.cfg.url is not None:
            if self._client is None:
                self._client = self.make_client(self.cfg.url, os.environ.get(self.cfg.token_env) or None)
                self._client.model_info()  # unreachable: a clear error naming the URL, before any work
            return self._client
        if self.proc is None or self.proc.poll() is not None:
            self._launch(version)
        assert self._client is not None, "a launched engine has its client"
        return self._client

    def alive(self) -> bool:
        return self.cfg.url is not None or (self.proc is not None and self.proc.poll() is None)

    def _launch(self, version: int) -> None:
        """Start the server with weights/v{version} (or, with LoRA sync or a version staged but not
        published, the initial weights, `version` loaded after) and wait until it is ready."""
        if self.proc is not None:
            if self.starts > self.cfg.restarts:
                raise EngineUnreachable(f"{self.server_name} died {self.starts} times (rollout.engine.restarts "
                                        f"{self.cfg.restarts}); its log:\n{self.log_tail()}")
            kill_tree(self.proc)
            self.log(f"{self.server_name} (pid {self.proc.pid}) exited with {self.proc.returncode}; starting it again")
        DedicatedEngine.close(self)  # the old client; the process is gone
        published = self.storage.exists(f"{self.storage.weights_rel(version)}/{MANIFEST}")
        base = 0 if self.cfg.sync.weights == "lora" or not published else version  # else staged after the start
        token = secrets.token_hex(16)
        argv, extra = self.launch_command(self.local(self.storage.weights_rel(base)), base, token)
        env = {**os.environ, **extra, "UNIRL_OWNER_PID": str(os.getpid())}
        if self.starts:  # a fault injected into the engine (UNIRL_FAULTS=engine-generate) hits its first start only
            env.pop("UNIRL_FAULTS", None)
        with open(self.log_path, "ab") as logf:
            self.proc = spawn(argv, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        self.log(f"{self.server_name} starting (pid {self.proc.pid}, log {self.log_path})")
        start = time.monotonic()
        deadline = start + self.cfg.startup_timeout_s
        while (url := self.ready_url(token)) is None:
            if self.proc.poll() is not None:
                raise EngineUnreachable(f"{self.server_name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                kill_tree(self.proc)
                raise EngineUnreachable(f"{self.server_name} not ready after {self.cfg.startup_timeout_s}s "
                                        f"(rollout.engine.startup_timeout_s):\n{self.log_tail()}")
            time.sleep(0.1)
        self.log(f"{self.server_name} ready at {url} after {time.monotonic() - start:.0f}s")
        self._client = self.make_client(url, token)
        self.lora_name = None
        self.after_launch(self._client, base)
        self._check_loaded(self._client, base, f"starting with {self.storage.weights_rel(base)}", None,
                           manifest=self.storage.read_json(f"{self.storage.weights_rel(base)}/{MANIFEST}"))
        if base != version:
            self._version = None

    def log(self, message: str) -> None:
        print(f"[unirl] {message}", file=sys.stderr, flush=True)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "", carried: str | None = None) -> dict[str, Any]:
        """As DedicatedEngine.generate; a launched engine that died mid-generate is named, started
        again from the published weights and asked again (nothing was committed), up to `restarts`."""
        while True:
            try:
                return super().generate(requests, out_dir, iteration, policy_version, greedy=greedy, seed_tag=seed_tag,
                                        carried=carried)
            except EngineUnreachable as exc:
                if self.cfg.url is None and self.proc is not None:
                    try:
                        self.proc.wait(timeout=10)  # a dying process closes its sockets before it is reaped
                    except subprocess.TimeoutExpired:
                        pass
                if self.cfg.url is not None or self.alive() or self.starts > self.cfg.restarts:
                    raise EngineUnreachable(f"{exc}; engine pid {self.proc.pid if self.proc else '-'}, log:\n{self.log_tail()}") from None
                self.log(f"{self.server_name} died during generate of iteration {iteration} ({exc}); restarting it")
                self._version = None

    def close(self) -> None:
        """Stop a launched engine process (a server at `url` is left running)."""
        super().close()
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc = None

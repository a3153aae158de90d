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
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from unirl.stages.engines.launched import LaunchedConfig, LaunchedEngine
from unirl.stages.engines.limits import Limits
from unirl.stages.runtime.registry import engines


def run_limits(recipe: Any) -> dict[str, int]:
    """The engine server's request limits (stages/engines/limits.py) raised where a run asks
    for more than their defaults, for its launch spec: a run's own requests are never refused."""
    rollout, default = recipe.rollout, Limits()
    out = {}
    if getattr(rollout, "max_new_tokens", 0) > default.max_new_tokens:
        out["max_new_tokens"] = rollout.max_new_tokens
    sampler = getattr(rollout, "sampler", None)
    if sampler is not None and sampler.num_steps > default.max_steps:
        out["max_steps"] = sampler.num_steps
    return out


class EngineServerConfig(LaunchedConfig):
    """unirl's own engine process (transformers / diffusers), launched by the run or at `url`."""

    name: Literal["engine_server"] = Field("engine_server", description="Rollout engine.")
    url: str | None = Field(None, description="http://host:port of a running `unirl engine-server`; empty: the run "
                            "launches one on loopback and stops it at the end.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="Where a launched engine serves: auto (the first GPU the engine's process sees, "
                        "else the CPU), cpu, cuda or cuda:N (docs/engines.md, placement).")
    threads: int = Field(1, ge=1, description="CPU threads of a launched engine.")
    cpus: list[int] = Field(default_factory=list, description="CPU cores a launched engine is pinned to (empty: not pinned).")
    max_batch: int = Field(64, ge=1, description="Requests the engine samples together at most.")
    batch_wait_ms: float = Field(5.0, ge=0, description="How long the engine waits for requests to join a batch.")


@engines.register("engine_server")
class EngineServer(LaunchedEngine):
    name = "engine_server"
    config = EngineServerConfig
    exact_replay = True
    loads_staged = True
    reports_checksum = True

    def launch_command(self, weights: Path, version: int, token: str) -> tuple[list[str], dict[str, str]]:
        """`python -m unirl.stages.engine_server --spec FILE`; it writes its port to a ready file."""
        self._ready = self.scratch / "engine-ready.json"
        self._ready.unlink(missing_ok=True)
        spec = {"recipe": self.recipe.model_dump(mode="json"), "weights": str(weights), "version": version,
                "host": "127.0.0.1", "port": 0, "ready_file": str(self._ready), "max_batch": self.cfg.max_batch,
                "batch_wait_ms": self.cfg.batch_wait_ms, "threads": self.cfg.threads, "cpus": list(self.cfg.cpus),
                "device": self.cfg.device,
                **run_limits(self.recipe)}
        spec_path = self.scratch / "engine-spec.json"
        spec_path.write_text(json.dumps(spec))
        return ([sys.executable, "-m", "unirl.stages.engine_server", "--spec", str(spec_path)],
                {"UNIRL_ENGINE_TOKEN": token, "OMP_NUM_THREADS": str(self.cfg.threads)})

    def ready_url(self, client_token: str) -> str | None:
        if not self._ready.exists():
            return None
        return f"http://127.0.0.1:{json.loads(self._ready.read_text())['port']}"

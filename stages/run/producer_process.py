"""The process of an async run's producer: `python -m unirl.flows.producer --spec FILE`, started by the
trainer's run, reporting to the same Prefect API (its own `rl-producer` flow run), dying with the
trainer (PR_SET_PDEATHSIG), and started again when it died on its own (a kill, a crash): it
resumes at the first batch it had not committed, so nothing is lost or sampled twice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from unirl.stages.runtime.scratch import log_tail, scratch_dir
from unirl.stages.workers.group import kill_tree, spawn


class ProducerGone(RuntimeError):
    """The producer died more often than it may be restarted."""


class ProducerProcess:
    def __init__(self, recipe: Any, run_name: str, *, api_url: str | None, restarts: int = 2,
                 log: Callable[[str], None] = print):
        self.recipe, self.run_name, self.api_url, self.restarts, self.log = recipe, run_name, api_url, restarts, log
        self.scratch = scratch_dir(f"unirl-producer-{run_name}-")
        self.log_path = self.scratch / "producer.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        spec = self.scratch / "spec.json"
        spec.write_text(json.dumps({"recipe": self.recipe.model_dump(mode="json"), "run_name": self.run_name}))
        env = {k: v for k, v in os.environ.items() if k != "UNIRL_FAULTS" or self.starts == 0}
        env["UNIRL_OWNER_PID"] = ""  # a fault point in the producer kills the producer, not the trainer
        if self.api_url:
            env["PREFECT_API_URL"] = self.api_url
        with open(self.log_path, "ab") as logf:
            self.proc = spawn([sys.executable, "-m", "unirl.flows.producer", "--spec", str(spec)], env=env,
                              stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1

    def alive(self) -> None:
        """Raise when the producer exited with an error more often than it may restart; restart it
        when it died (a clean exit means it produced every batch)."""
        if self.proc is None:
            self.start()
            return
        code = self.proc.poll()
        if code is None or code == 0:
            return
        if self.starts > self.restarts:
            raise ProducerGone(f"the producer (pid {self.proc.pid}) exited with {code}, {self.starts} start(s); its "
                               f"log {self.log_path}:\n{self.tail()}")
        self.log(f"producer (pid {self.proc.pid}) exited with {code}; starting it again (it resumes at its first "
                 "uncommitted batch)")
        self.start()

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc = None

"""SIGTERM (Prefect cancellation, Kubernetes, `kill`) stops a `unirl run` as Ctrl-C does, in every
phase: within seconds, with the line that says how to resume, nothing left running, and the same
command then goes on from the last commit. A worker group busy in a command (the VAE warm-up, an
update) is killed rather than asked to shut down after it."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import zygote
from tests.conftest import REPO, TINY, run_unirl
from tests.e2e.test_rl_flow import SIGNAL, check_layout
from unirl.flows.hooks import worker_processes

pytestmark = pytest.mark.slow

RESUME_LINE = "interrupted; run the same command again to resume"
DIFFUSION = REPO / "recipes" / "diffusion" / "quickstart.yaml"
# A VAE warm-up far longer than the test: SIGTERM lands in it for certain.
LONG_WARMUP = ["iterations=1", "rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sampler.num_steps=3",
               "train.micro_batch_size=4", "eval.enabled=false", "model.tiny.patch_size=4", "sft.steps=3", "sft.examples=16",
               "sft.batch_size=8", "model.vae_warmup.steps=100000", "model.vae_warmup.batch_size=8"]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return zygote.popen([sys.executable, "-m", "unirl.flows.cli", *args], env=env, cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT)


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"never printed {text!r}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def terminate(proc: subprocess.Popen, log: Path, run: Path, within: float) -> None:
    """SIGTERM; the run exits 130 within `within` seconds, says how to resume, and leaves no worker."""
    children = worker_processes(lambda url: url.rstrip("/").endswith(str(run)))
    assert children, "no worker group was running"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130, log.read_text()[-4000:]
    took = time.monotonic() - sent
    assert took < within, f"the run took {took:.1f} s to stop"
    assert RESUME_LINE in log.read_text()
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "workers outlived the run"


def test_sigterm_during_the_vae_warm_up_stops_in_seconds_and_the_run_starts_again(tmp_path, unirl_env):
    root = tmp_path / "runs"
    args = ["run", str(DIFFUSION), f"storage.root={root}", *LONG_WARMUP]
    for attempt in range(2):  # the second start is the same command: not refused (the lease was let go), warming up again
        log = tmp_path / f"warm{attempt}.log"
        proc = start(args, unirl_env, log)
        try:
            wait_for_line(proc, log, "the VAE learns the SFT media first (100000 steps of batch 8)")
            time.sleep(1.0)  # inside the warm-up's command, which alone would take hours
            terminate(proc, log, root / "diffusion-quickstart", within=15)
        finally:
            proc.kill()


def test_sigterm_during_rl_stops_in_seconds_and_the_same_command_resumes(tmp_path, unirl_env):
    root = tmp_path / "runs"
    args = ["run", str(TINY), "iterations=6", SIGNAL, "checkpoint_every=2", f"storage.root={root}"]
    log = tmp_path / "rl.log"
    proc = start(args, unirl_env, log)
    try:
        wait_for_line(proc, log, "[unirl] iter-000002 (3/6)")
        terminate(proc, log, root / "tiny", within=15)
    finally:
        proc.kill()
    done = sorted(p.parent.name for p in (root / "tiny").glob("iter-*/_SUCCESS"))
    assert done[:3] == ["iter-000000", "iter-000001", "iter-000002"] and len(done) < 6
    out = run_unirl(args, unirl_env)
    assert "[unirl] iter-000000 (" not in out.stdout and f"[unirl] iter-{len(done):06d} ({len(done) + 1}/6)" in out.stdout
    check_layout(root / "tiny", 6)

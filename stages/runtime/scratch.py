"""Scratch folders in the system temp dir (a worker group's spec and logs, a copy of published
weights for an engine, a producer's log): removed when the process that made them exits, and, when
it was killed before it could (SIGKILL, the OOM killer, a lost node), by the next unirl process that
makes one. Each folder carries an owner file (pid and that process's start time, so a recycled pid
is not mistaken for the owner); a folder whose owner is gone is removed."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = ".unirl-owner"
PREFIX = "unirl-"
_made: list[Path] = []


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(folder: Path) -> bool:
    try:
        pid_text, started = (folder / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return True  # not (yet) ours to judge: a folder being made, or not made by this module
    return _started(int(pid_text)) == started


def sweep(parent: Path | None = None) -> list[Path]:
    """Remove the scratch folders under `parent` (the system temp dir) whose owner process is gone;
    returns what was removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(PREFIX) and (p / OWNER_FILE).is_file()]
    except OSError:
        return removed
    for folder in candidates:
        if not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def scratch_dir(prefix: str, parent: Path | None = None) -> Path:
    """A new folder in `parent` (default the temp dir), named `prefix` plus mkdtemp's random suffix
    (prefix starts with "unirl-"), owned by this process and removed at its exit; stale folders of
    dead processes are swept first."""
    assert prefix.startswith(PREFIX), prefix
    sweep(parent)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {_started(os.getpid())}")
    _made.append(folder)
    return folder


def shared_memory_dir() -> Path:
    """Where a file lives in memory, not on disk: /dev/shm (tmpfs) where this host has it writable,
    else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


def _remove_own() -> None:
    """At exit: this process's folders (a forked child inherits the list, not the folders)."""
    for folder in _made:
        try:
            owner = int((folder / OWNER_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if owner == os.getpid():
            shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_own)


def log_tail(path: Path, lines: int, missing: str = "(no log)") -> str:
    """The last `lines` lines of a process's log file (undecodable bytes replaced), or `missing`."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return missing

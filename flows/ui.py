"""`unirl ui [STORE] [--port N]`: MLflow's UI over a storage root's one store, so every run of
the root (one experiment per recipe) sits in one table and on one chart.

STORE is a storage root (its `mlflow.db`; default `runs`, the recipes' `storage.root`), a SQLite
file (a run folder's own `mlflow.db`, from before one store per root), or a tracking URI. The UI
serves on port 5000 when it is free, else on a free port it names; the links a run prints say 5000.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from unirl.stages.run.tracking import MLFLOW_PORT, STORE, TRAINING_VIEW
from unirl.stages.runtime.secrets import redact_url


def store_uri(store: str) -> str:
    """The tracking URI of STORE; a folder or file that holds no store is an error saying what to pass."""
    if "://" in store:
        return store
    path = Path(store)
    if path.is_dir():
        path = path / STORE
    if not path.is_file():
        raise ValueError(f"{store}: no MLflow store there; pass a storage root (its {STORE} is written when a run "
                         "starts), a .db file, or a tracking URI")
    return f"sqlite:///{path.resolve()}"


def free_port(preferred: int, host: str) -> int:
    """`preferred` when nothing listens on it, else a port the system hands out."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError(f"no free port on {host}")


def serve(store: str, port: int | None, host: str = "127.0.0.1") -> int:
    """Replace this process with `mlflow ui` over STORE (exit 2 when STORE is not a store)."""
    try:
        uri = store_uri(store)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if uri.startswith(("http://", "https://")):
        print(f"[unirl] {redact_url(uri)} is a tracking server: open it in a browser", flush=True)
        return 0
    chosen = port or free_port(MLFLOW_PORT, host)
    moved = "" if chosen == MLFLOW_PORT or port else f" ({MLFLOW_PORT} is taken: put {chosen} in the links runs print)"
    print(f"[unirl] MLflow UI of {redact_url(uri)} at http://{host}:{chosen}/#/?{TRAINING_VIEW}{moved}; Ctrl-C stops it",
          flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                              "--host", host, "--port", str(chosen), "--workers", "1"])
    return 0  # not reached: execv replaces the process

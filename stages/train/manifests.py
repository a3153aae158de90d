"""Manifests of what a run publishes and checkpoints: the sha256 of every file, written last, so a
folder without its manifest is incomplete and a file that does not match it is corrupt. No torch
here: the flow process and the CLI check and write manifests without loading it."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unirl.stages.runtime.storage import join

MANIFEST = "manifest.json"


def file_digests(storage: Any, rel: str) -> dict[str, dict[str, Any]]:
    """{name: {sha256, bytes}} of every file under `rel` (names relative to it)."""
    out = {}
    for name in storage.files(rel):
        if name in (MANIFEST, "_COMMITTED"):
            continue
        data = storage.read_bytes(join(rel, name))
        out[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return out


def checkpoint_problem(storage: Any, version: int) -> str | None:
    """Why checkpoint `version` cannot be restored (None: it can): not committed, or a file that
    is missing or does not match the manifest."""
    rel = storage.checkpoint_rel(version)
    if not storage.exists(join(rel, "_COMMITTED")):
        return "it was never committed (the save was interrupted)"
    if not storage.exists(join(rel, MANIFEST)):
        return None  # written before checkpoints had manifests: nothing to verify against
    for name, what in mismatches(storage, rel, first=True):
        where = storage.url(join(rel, name))
        return f"{where} is missing" if what == "missing" else f"{where} does not match its sha256 in {MANIFEST} (corrupted)"
    return None


def mismatches(storage: Any, rel: str, first: bool = False) -> list[tuple[str, str]]:
    """(name, "missing" | "sha256") of each file listed in `rel`/manifest.json that is missing or
    whose sha256 is not the manifest's, by name; empty: the folder matches its manifest. Files the
    manifest does not list are not looked at (a registered version's MLmodel is written after it).
    `first`: stop at the first."""
    out = []
    for name, info in sorted(storage.read_json(join(rel, MANIFEST))["files"].items()):
        path = join(rel, name)
        if not storage.exists(path):
            out.append((name, "missing"))
        elif stored_sha256(storage, path) != info["sha256"]:
            out.append((name, "sha256"))
        if out and first:
            break
    return out


def stored_sha256(storage: Any, rel: str) -> str:
    """sha256 of a run file (read in chunks on local disk, whole from an object store)."""
    local = storage.local_path(rel)
    return sha256_file(local) if local is not None else hashlib.sha256(storage.read_bytes(rel)).hexdigest()


def usable_checkpoint(storage: Any, at_most: int, log: Callable[[str], None]) -> int | None:
    """The newest restorable checkpoint at or below version `at_most` (None: start from the initial
    weights); every newer one passed over is reported through `log`."""
    versions = sorted({int(n) for n in storage.listdir("checkpoints") if n.isdigit()}, reverse=True)
    for version in (v for v in versions if v <= at_most):
        problem = checkpoint_problem(storage, version)
        if problem is None:
            return version
        log(f"checkpoint {version:06d} is not usable: {problem}; trying an older one")
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_weights_dir(storage: Any, local: Path, rel: str, info: dict[str, Any]) -> dict[str, Any]:
    """Upload every file of `local` to `rel`, then the sha256 manifest."""
    files = {}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        name = path.relative_to(local).as_posix()
        storage.put_file(path, join(rel, name))
        files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {**info, "files": files}
    storage.write_json(join(rel, MANIFEST), manifest)
    return manifest


def verify_weights_dir(directory: Path) -> None:
    """Check a downloaded weights folder against its manifest; name the first bad file."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for name, info in manifest["files"].items():
        if sha256_file(directory / name) != info["sha256"]:
            raise ValueError(f"{directory / name}: sha256 does not match {MANIFEST}; the copy is corrupt")

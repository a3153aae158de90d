"""The run layout (docs/architecture.md, "Storage") on any fsspec URL.

Commit protocol: every file is written whole (temp file then rename on local disk; object stores
make a single PUT visible atomically), and a stage's outputs count only once its manifest
(`iter-NNNNNN/manifests/<stage>.json`) exists; the manifest is written last. An iteration is done
when `iter-NNNNNN/_SUCCESS` exists; a run resumes after the last one.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import posixpath
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import tenacity
from fsspec.implementations.local import LocalFileSystem

from unirl.stages.runtime.lease import check_held

ITER_RE = re.compile(r"^iter-(\d{6})$")
CKPT_RE = re.compile(r"^(\d{6})$")
WEIGHTS_RE = re.compile(r"^v(\d{6})$")


def iter_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def retry_s() -> float:
    """How long object-store calls are retried while the store is unreachable (an outage, a
    restart): `UNIRL_STORAGE_RETRY_S`, 300 s by default, read when a call is made."""
    return float(os.environ.get("UNIRL_STORAGE_RETRY_S", "300"))


# Set when the process is being interrupted (Ctrl-C): retries of every thread stop at once and
# their last error is raised, so an interrupt never waits for an outage to end.
STOPPING = threading.Event()
# botocore and aiohttp connection failures, matched by class name (aiohttp need not be installed).
_TRANSIENT = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
              "ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}
# S3 error codes and HTTP statuses of a store that is overloaded or restarting, not of a wrong request.
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "RequestTimeout", "Throttling", "ThrottlingException",
                    "RequestLimitExceeded", "InternalError", "500", "503"}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}


def _chain(exc: BaseException | None):
    """`exc`, then what it was raised from or while handling, outermost first (s3fs raises an
    OSError from botocore's ClientError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def transient(exc: BaseException) -> bool:
    """Whether an object-store error is the store being unreachable for a while (worth a retry),
    not a wrong request. Decided by exception class and S3 error code, never by message text (a
    missing `iter-000503/...` names 503 and is still missing); the first exception of the chain
    that tells wins, and a missing file or a refused permission is never transient."""
    from botocore.exceptions import ClientError  # start-up time: botocore loads on first use, not when a recipe is read

    if not isinstance(exc, Exception):  # an interrupt or an exit, whatever it interrupted
        return False
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError)):
            return False
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _MISSING_CODES or status == 404:
                return False
            return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
        if isinstance(e, (ConnectionError, TimeoutError)) or any(c.__name__ in _TRANSIENT for c in type(e).__mro__):
            return True
    return False


_PROCESS_CAS = threading.Lock()


def _local_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _local_at(path: str, tag: str) -> bool:
    """Whether the local file `path` exists at version `tag`."""
    try:
        return _local_tag(os.stat(path)) == tag
    except FileNotFoundError:
        return False


def _precondition_failed(exc: BaseException) -> bool:
    """Whether an object-store error is a conditional request whose condition did not hold."""
    from botocore.exceptions import ClientError  # start-up time: botocore loads on first use, not when a recipe is read

    for e in _chain(exc):
        if isinstance(e, FileExistsError):
            return True
        if isinstance(e, ClientError) and str(e.response.get("Error", {}).get("Code", "")) in ("PreconditionFailed", "412"):
            return True
    return False


def _sleep(seconds: float) -> None:
    """A retry's wait, cut short when the process is being interrupted."""
    STOPPING.wait(seconds)


def interrupt(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM handler of `unirl` commands: stop all object-store retries, then interrupt
    as Python does on Ctrl-C (KeyboardInterrupt in the main thread)."""
    STOPPING.set()
    raise KeyboardInterrupt


def no_space(exc: OSError, where: str) -> OSError:
    """A clear error for a full disk or quota, naming the file being written."""
    return OSError(exc.errno, f"{where}: no space left on the device (or quota) while writing it; nothing of it was "
                   "committed. Free space (or use a larger storage.root) and rerun the same command: the run resumes")


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_name(name: str, field: str) -> str:
    """A run name is a plain folder name under the storage root: letters, digits, '.', '_', '-',
    not starting with '.' or '-' (no '/', '..', URL characters: it cannot leave the root)."""
    if not RUN_NAME.fullmatch(name or "") or ".." in name:
        raise ValueError(f"{field}: {name!r} is not a plain run name; use letters, digits, '.', '_' and '-' "
                         "(at most 128, starting with a letter or digit)")
    return name


SPLITS = ("dev", "test")
PREFIX = {"dev": "eval", "test": "test"}  # metric keys: eval/accuracy, test/accuracy


def eval_dir(version: int, split: str = "dev") -> str:
    """eval/vNNNNNN for the dev split, eval/vNNNNNN/test for the test split."""
    if split not in SPLITS:
        raise ValueError(f"unknown evaluation split {split!r} (allowed: {', '.join(SPLITS)})")
    base = join("eval", f"v{version:06d}")
    return base if split == "dev" else join(base, split)


class RunStorage:
    """Files of one run: `{root}/{run}/...`, addressed by paths relative to the run folder."""

    def __init__(self, root: str, run: str, options: dict[str, Any] | None = None):
        check_run_name(run, "run name")
        self.root = root
        self.run = run
        self.options = dict(options or {})
        self.fs, base = fsspec.core.url_to_fs(root, **self.options)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            base = str(Path(base).resolve())
        self.base = join(base.rstrip("/") or "/", run)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.protocol = protocol

    # -- addressing -------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The full path of `rel` inside the run folder; a path that would leave it (absolute,
        `..`, a URL) is an error naming it, wherever it came from (a manifest, a command)."""
        if not rel:
            return self.base
        clean = posixpath.normpath(rel)
        if rel.startswith("/") or "://" in rel or "\x00" in rel or clean == ".." or clean.startswith("../"):
            raise ValueError(f"{rel!r} is not a path inside the run folder {self.url()}; run-relative paths cannot "
                             "be absolute, contain '..' that leaves the folder, or be URLs")
        return join(self.base, clean)

    def url(self, rel: str = "") -> str:
        """A URL another process can open (never memory:// across processes)."""
        p = self.path(rel)
        return p if self.local else f"{self.protocol}://{p.lstrip('/')}" if self.protocol != "memory" else f"memory://{p}"

    def local_path(self, rel: str = "") -> Path | None:
        return Path(self.path(rel)) if self.local else None

    # -- writing ----------------------------------------------------------------------------
    def io(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the store; on an object store that is unreachable for a while,
        retried with exponential backoff (1 s doubling to 15 s) for up to `retry_s()` seconds, saying so
        on stderr; the last error is raised as it was."""
        if self.local:
            return fn(*args, **kwargs)

        def say(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None and state.next_action is not None, "before_sleep follows a failed attempt"
            print(f"[unirl] storage {self.url()} unreachable ({what}: {type(state.outcome.exception()).__name__}); "
                  f"retrying in {state.next_action.sleep:.0f}s", file=sys.stderr, flush=True)

        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception(transient),
                                     wait=tenacity.wait_exponential(multiplier=1, min=1, max=15),
                                     stop=tenacity.stop_before_delay(retry_s()) | tenacity.stop_when_event_set(STOPPING),
                                     sleep=_sleep, before_sleep=say, reraise=True)
        return retrying(fn, *args, **kwargs)

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write a whole file so that readers see all of it or nothing (a temporary file renamed
        on local disk, removed again when the disk is full; one PUT on an object store)."""
        target = self.path(rel)
        parent = posixpath.dirname(target)
        if self.local:
            os.makedirs(parent, exist_ok=True)
            try:
                tmp = self._local_tmp(target, data)
                try:
                    os.replace(tmp, target)
                except OSError:
                    os.remove(tmp)
                    raise
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise no_space(exc, self.url(rel)) from exc
                raise
        else:
            self.io(f"write {rel}", self.fs.makedirs, parent, exist_ok=True)
            self.io(f"write {rel}", self.fs.pipe_file, target, data)
        return target

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def write_text(self, rel: str, text: str) -> str:
        return self.write_bytes(rel, text.encode())

    def remove(self, rel: str) -> None:
        """Delete one file (gone already is fine)."""
        try:
            if self.local:
                os.remove(self.path(rel))
            else:
                self.io(f"remove {rel}", self.fs.rm_file, self.path(rel))
        except FileNotFoundError:
            pass

    def put_file(self, local: str | Path, rel: str) -> str:
        with open(local, "rb") as fh:
            return self.write_bytes(rel, fh.read())

    # -- compare-and-swap (the run's lease) -------------------------------------------------
    # A file's version tag: on local disk its inode, mtime and size (every write is a rename, so a
    # new inode); on S3 its ETag. Of two writers that race, exactly one succeeds: local disk by an
    # exclusive link(2) and, for replace and remove, a flock(2) on `.<name>.lock` beside the file;
    # S3 by conditional requests (If-None-Match: *, If-Match: <etag>). Any other fsspec store
    # (memory://, one process) compares under a lock of this process.
    def create_new(self, rel: str, data: bytes) -> str | None:
        """Write `rel` only if no file is there: its version tag, or None when one was."""
        target = self.path(rel)
        if self.local:
            os.makedirs(posixpath.dirname(target), exist_ok=True)
            tmp = self._local_tmp(target, data)
            try:
                os.link(tmp, target)
            except FileExistsError:
                return None
            finally:
                tag = _local_tag(os.stat(tmp))
                os.remove(tmp)
            return tag
        if self.protocol in ("s3", "s3a"):
            try:
                return self.io(f"create {rel}", self.fs.pipe_file, target, data, mode="create")["ETag"]
            except OSError as exc:
                if _precondition_failed(exc):
                    return None
                raise
        with _PROCESS_CAS:
            if self.fs.exists(target):
                return None
            self.fs.pipe_file(target, data)
            return self._other_tag(target)

    def read_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """`rel`'s content and version tag read together, or None when there is no such file."""
        target = self.path(rel)
        if self.local:
            try:
                with open(target, "rb") as fh:
                    return fh.read(), _local_tag(os.fstat(fh.fileno()))
            except FileNotFoundError:
                return None
        if self.protocol in ("s3", "s3a"):
            from fsspec.asyn import sync  # start-up time: fsspec loads on first use, not when a recipe is read

            async def get() -> tuple[bytes, str]:
                bucket, key, _ = self.fs.split_path(target)
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                try:
                    return await resp["Body"].read(), resp["ETag"]
                finally:
                    resp["Body"].close()

            try:
                return self.io(f"read {rel}", sync, self.fs.loop, get)
            except FileNotFoundError:
                return None
        with _PROCESS_CAS:
            return (self.fs.cat_file(target), self._other_tag(target)) if self.fs.exists(target) else None

    def replace_tagged(self, rel: str, data: bytes, tag: str) -> str | None:
        """Overwrite `rel` only if it is still at version `tag`: the new tag, or None when it is not
        (changed or gone)."""
        target = self.path(rel)
        if self.local:
            with self._local_lock(target):
                if not _local_at(target, tag):
                    return None
                tmp = self._local_tmp(target, data)
                new = _local_tag(os.stat(tmp))
                os.replace(tmp, target)
                return new
        if self.protocol in ("s3", "s3a"):
            try:
                return self.io(f"replace {rel}", self.fs.pipe_file, target, data, IfMatch=tag)["ETag"]
            except (OSError, FileNotFoundError) as exc:
                if isinstance(exc, FileNotFoundError) or _precondition_failed(exc):
                    return None
                raise
        with _PROCESS_CAS:
            if not self.fs.exists(target) or self._other_tag(target) != tag:
                return None
            self.fs.pipe_file(target, data)
            return self._other_tag(target)

    def remove_tagged(self, rel: str, tag: str) -> bool:
        """Delete `rel` only if it is still at version `tag`: whether it was."""
        target = self.path(rel)
        if self.local:
            with self._local_lock(target):
                if not _local_at(target, tag):
                    return False
                os.remove(target)
                return True
        if self.protocol in ("s3", "s3a"):
            from fsspec.asyn import sync  # start-up time: fsspec loads on first use, not when a recipe is read

            bucket, key, _ = self.fs.split_path(target)
            try:
                self.io(f"remove {rel}", sync, self.fs.loop, self.fs._call_s3, "delete_object", Bucket=bucket, Key=key,
                        IfMatch=tag)
            except (OSError, FileNotFoundError) as exc:
                if isinstance(exc, FileNotFoundError) or _precondition_failed(exc):
                    return False
                raise
            finally:
                self.fs.invalidate_cache(target)
            return True
        with _PROCESS_CAS:
            if not self.fs.exists(target) or self._other_tag(target) != tag:
                return False
            self.fs.rm_file(target)
            return True

    def _local_tmp(self, target: str, data: bytes) -> str:
        """`data` in a new temporary file beside `target`, synced to disk: its path (nothing is left
        behind when the write fails)."""
        tmp = join(posixpath.dirname(target), f".{posixpath.basename(target)}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return tmp

    @staticmethod
    @contextlib.contextmanager
    def _local_lock(target: str) -> Iterator[None]:
        with open(join(posixpath.dirname(target), f".{posixpath.basename(target)}.lock"), "a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _other_tag(self, target: str) -> str:
        return hashlib.sha256(self.fs.cat_file(target)).hexdigest()

    # -- reading ----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self.io(f"exists {rel}", self.fs.exists, self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.io(f"read {rel}", self.fs.cat_file, self.path(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under `rel`; empty when it does not exist."""
        try:
            entries = (self.io(f"list {rel}", self.fs.ls, self.path(rel), detail=False, refresh=True) if not self.local
                       else os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def files(self, rel: str) -> list[str]:
        """Every file under the folder `rel`, as paths relative to it, sorted."""
        out = []
        for name in self.listdir(rel):
            sub = join(rel, name)
            if self.io(f"stat {sub}", self.fs.isdir, self.path(sub)):
                out += [join(name, f) for f in self.files(sub)]
            else:
                out.append(name)
        return sorted(out)

    def get_dir(self, rel: str, local_dir: str | Path) -> Path:
        """Copy a folder of the run to a local directory (for libraries that need local files)."""
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        for name in self.listdir(rel):
            src = join(rel, name)
            if self.io(f"stat {src}", self.fs.isdir, self.path(src)):
                self.get_dir(src, local_dir / name)
            else:
                (local_dir / name).write_bytes(self.read_bytes(src))
        return local_dir

    # -- stage commits ----------------------------------------------------------------------
    def manifest_rel(self, iteration: int, stage: str) -> str:
        return join(iter_dir(iteration), "manifests", f"{stage}.json")

    def commit_stage(self, iteration: int, stage: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Mark a stage's outputs as complete by writing its manifest (after all its files)."""
        for rel in manifest.get("files", []):
            if not self.exists(rel):
                raise FileNotFoundError(f"{stage} manifest lists {self.url(rel)}, which was not written")
        check_held(self.url())
        self.write_json(self.manifest_rel(iteration, stage), manifest)
        return manifest

    def stage_manifest(self, iteration: int, stage: str) -> dict[str, Any] | None:
        rel = self.manifest_rel(iteration, stage)
        return self.read_json(rel) if self.exists(rel) else None

    def mark_success(self, iteration: int, summary: dict[str, Any]) -> None:
        check_held(self.url())
        self.write_json(join(iter_dir(iteration), "_SUCCESS"), summary)

    def is_success(self, iteration: int) -> bool:
        return self.exists(join(iter_dir(iteration), "_SUCCESS"))

    def iterations(self) -> list[int]:
        return [int(m.group(1)) for n in self.listdir() if (m := ITER_RE.match(n))]

    def last_success(self) -> int:
        """Index of the last finished iteration with every earlier one finished too, else -1."""
        done = -1
        for i in self.iterations():
            if i != done + 1 or not self.is_success(i):
                break
            done = i
        return done

    # -- checkpoints and weights ------------------------------------------------------------
    def checkpoint_rel(self, version: int) -> str:
        return join("checkpoints", f"{version:06d}")

    def checkpoints(self) -> list[int]:
        """Committed checkpoint versions, ascending."""
        return self._committed("checkpoints", CKPT_RE, "_COMMITTED")

    def _committed(self, folder: str, pattern: re.Pattern, marker: str) -> list[int]:
        """Versions of `folder/<name>` whose names match `pattern` and that hold `marker`."""
        out = []
        for name in self.listdir(folder):
            m = pattern.match(name)
            if m and self.exists(join(folder, name, marker)):
                out.append(int(m.group(1)))
        return out

    def weights_rel(self, version: int) -> str:
        return join("weights", f"v{version:06d}")

    def adapters_rel(self, version: int) -> str:
        """LoRA adapters alone of policy `version` (what a LoRA weight sync sends an engine)."""
        return join("adapters", f"v{version:06d}")

    def weights_versions(self) -> list[int]:
        """Published weight versions (those with a manifest), ascending."""
        return self._committed("weights", WEIGHTS_RE, "manifest.json")

    def adapter_versions(self) -> list[int]:
        """Published LoRA adapter versions (those with a manifest), ascending."""
        return self._committed("adapters", WEIGHTS_RE, "manifest.json")


def committed_batch(storage: RunStorage, iteration: int) -> dict[str, Any] | None:
    """What iteration `iteration`'s train step reads, from its committed manifests: {"rollouts":
    the files of its generate stages, "advantages": its advantages file}; None while one of them
    is not committed."""
    # generate, then its refill rounds generate-r1, ... (a unified model's: generate-<stage>, in any order)
    rounds = sorted(
        (n[:-len(".json")] for n in storage.listdir(join(iter_dir(iteration), "manifests")) if n.startswith("generate")),
        key=lambda name: int(m.group(1)) if (m := re.fullmatch(r"generate-r(\d+)", name)) else 0,
    )
    gens = [storage.stage_manifest(iteration, name) for name in rounds]
    adv = storage.stage_manifest(iteration, "advantage")
    if not gens or None in gens or adv is None:
        return None
    return {"rollouts": [f for gen in gens if gen is not None for f in gen["files"]], "advantages": adv["files"][0]}

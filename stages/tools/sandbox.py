"""Run a tool server with no network and no writes outside its scratch folder:

    python -m unirl.stages.tools.sandbox --scratch DIR -- COMMAND ...

It enters new network and mount namespaces (unshare(2): the network namespace has no interface
up, so nothing is reachable, loopback included), bind-mounts the scratch folder onto itself,
remounts every other mount read-only, makes the scratch folder the working, home and temporary
folder, and execs the command. It needs CAP_SYS_ADMIN (root, as the workers run in containers) or
unprivileged user namespaces; where neither is there it exits with status 3 and says so on stderr,
and the run stops naming `agent.sandbox` (set it false to run tools unsandboxed, knowingly).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
UNAVAILABLE = 3


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(libc: ctypes.CDLL, source: str | None, target: str, flags: int) -> None:
    if libc.mount(source and source.encode(), target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(line.split()[4].encode().decode("unicode_escape"))
    return points


def enter(scratch: str) -> None:
    """Enter the sandbox (this process and what it execs)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET) != 0:
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise PermissionError(f"cannot enter network and mount namespaces ({os.strerror(err)}): the tool sandbox needs "
                                  "CAP_SYS_ADMIN or unprivileged user namespaces")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)
    _mount(libc, scratch, scratch, MS_BIND | MS_REC)
    for point in _mount_points():
        if point == scratch or point.startswith(scratch.rstrip("/") + "/"):
            continue
        try:
            _mount(libc, None, point, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except OSError:
            if point == "/":
                raise
            # a mount that cannot be remounted (a pseudo file system): writes to it stay as they were
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    scratch = os.path.realpath(args.scratch)
    os.makedirs(scratch, exist_ok=True)
    try:
        enter(scratch)
    except OSError as exc:
        print(f"unirl tool sandbox: {exc}", file=sys.stderr, flush=True)
        return UNAVAILABLE
    os.execvp(command[0], command)
    return 0  # not reached: exec replaced the process


if __name__ == "__main__":
    raise SystemExit(main())

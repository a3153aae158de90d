"""Run a tool server isolated from the run that calls it:

    python -m unirl.stages.tools.sandbox --scratch DIR [--cpu-s S] [--memory-mb M] [--files F] [--procs P] -- COMMAND ...

Every step below must succeed, or nothing runs: the process exits with status 3 and one stderr
line naming the step that failed (`agent.sandbox: false` runs tools unsandboxed, knowingly).

1. New network, mount and PID namespaces (unshare(2); with unprivileged user namespaces where the
   process lacks CAP_SYS_ADMIN). The network namespace has no interface up: nothing is reachable,
   loopback included.
2. The scratch folder bind-mounted onto itself and every other mount remounted read-only (its
   nosuid/nodev/noexec flags kept, as the kernel requires).
3. A fresh, read-only /proc of the new PID namespace: the run's processes, and the environment
   and command lines they hold, are out of sight.
4. The scratch folder as working, home and temporary folder.
5. Limits: CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL 5 s later), data memory per process
   (RLIMIT_DATA: an allocation past it fails), open files (RLIMIT_NOFILE) and processes
   (RLIMIT_NPROC, which the kernel does not apply to root). The namespace's first process stays
   as a supervisor: it reaps orphans and, every 20 ms, counts the namespace's processes and their
   resident memory (shared pages split among the processes that share them); at `--procs` or
   past `--memory-mb` it kills them all (which holds for root too,
   and for memory spread over many processes).

When the tool server ends, everything it started ends with it. A stop for a limit is reported as
one stderr line starting `unirl tool sandbox: stopped:` (the client quotes it in the observation
of the call that was running).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import signal
import sys
import time

from unirl.stages.runtime.processes import Limits

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x40000000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG = 1
UNAVAILABLE = 3
STOPPED = "unirl tool sandbox: stopped:"
POLL_S = 0.02


class IsolationError(OSError):
    """An isolation step that failed: the tool server does not start."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(libc: ctypes.CDLL, source: str | None, target: str, flags: int, fstype: str | None = None) -> None:
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags, None) != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(line.split()[4].encode().decode("unicode_escape"))
    return points


def _kept_flags(point: str) -> int:
    """The flags a bind remount of `point` must keep (a mount locked by its namespace refuses to lose them)."""
    flag = os.statvfs(point).f_flag
    pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    return sum(ms for st, ms in pairs if flag & st)


def enter(scratch: str) -> None:
    """Steps 1 and 2 for this process; its next child is the first process of the new PID namespace."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if libc.unshare(flags) != 0:
        if libc.unshare(CLONE_NEWUSER | flags) != 0:
            err = ctypes.get_errno()
            raise IsolationError(err, f"namespaces: cannot enter new network, mount and PID namespaces ({os.strerror(err)}); "
                                 "the tool sandbox needs CAP_SYS_ADMIN or unprivileged user namespaces")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)
    _mount(libc, scratch, scratch, MS_BIND | MS_REC)
    for point in _mount_points():
        if point == scratch or point.startswith(scratch.rstrip("/") + "/") or point == "/proc":
            continue  # /proc: step 3 covers it with the new namespace's own
        try:
            _mount(libc, None, point, MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(point))
        except OSError as exc:
            raise IsolationError(exc.errno or 0, f"read-only remount of {point}: {exc.strerror or exc}") from None


def _own_proc(libc: ctypes.CDLL) -> None:
    """Step 3, in the PID namespace's first process."""
    _mount(libc, "proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "proc")


def _limit(limits: Limits) -> None:
    """Step 5's kernel limits, in the process that becomes the tool server."""
    memory = limits.memory_mb << 20
    for what, soft, hard in ((resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 5), (resource.RLIMIT_DATA, memory, memory),
                             (resource.RLIMIT_NOFILE, limits.files, limits.files),
                             (resource.RLIMIT_NPROC, limits.procs, limits.procs)):
        resource.setrlimit(what, (soft, hard))


def _census() -> tuple[int, int]:
    """(processes, resident bytes) of this PID namespace, this supervisor left out. Resident bytes
    are the quick sum of each process's resident set first; only past the limit are they summed
    again as proportional shares (smaps_rollup's Pss), so pages that forked processes share count once."""
    pids, rss, page = [], 0, os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        pids.append(name)
        try:
            with open(f"/proc/{name}/statm") as f:
                rss += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):  # it ended while we looked
            pass
    return len(pids), rss


def _proportional() -> int:
    """The namespace's resident bytes, shared pages split among their processes."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/smaps_rollup") as f:
                total += next(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            pass
    return total


def _kill_all() -> None:
    """Every process of the namespace but this one; reaped."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _stopped(reason: str) -> None:
    print(f"{STOPPED} {reason}", file=sys.stderr, flush=True)


def supervise(tool: int, limits: Limits) -> int:
    """The namespace's first process after it started the tool server (`tool`): its exit status,
    after every process it left is gone; a limit crossed stops them all."""
    def stop(signum: int, _frame: object) -> None:
        _kill_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
            if pid == tool:
                _kill_all()
                if os.WIFSIGNALED(status):
                    sig = os.WTERMSIG(status)
                    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the server's, now that it is reaped
                    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= limits.cpu_s):
                        _stopped(f"CPU limit ({limits.cpu_s} CPU seconds of agent.limits.cpu_s)")
                    return 128 + sig
                return os.WEXITSTATUS(status)
        count, rss = _census()
        if count >= limits.procs:  # the kernel refuses more to a server that is not root; this stops it
            _kill_all()
            _stopped(f"process limit ({count} processes, agent.limits.procs {limits.procs})")
            return 137
        if rss > limits.memory_mb << 20 and (rss := _proportional()) > limits.memory_mb << 20:
            _kill_all()
            _stopped(f"memory limit ({rss >> 20} MiB resident, agent.limits.memory_mb {limits.memory_mb})")
            return 137
        time.sleep(POLL_S)


def _own_user(uid: int, gid: int) -> None:
    """The tool server's own user namespace (the same ids mapped through): the kernel counts its
    processes against RLIMIT_NPROC, which it never does for root of the first namespace."""
    libc = _libc()
    if libc.unshare(CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, f"process limit: cannot enter a user namespace ({os.strerror(err)})")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _namespace_init(scratch: str, command: list[str], limits: Limits) -> int:
    """The PID namespace's first process: the tool server as its child, in a user namespace of its
    own (made while the first /proc is still there to write its id maps), then steps 3 and 4."""
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    uid, gid = os.getuid(), os.getgid()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    tool = os.fork()
    if tool == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            _own_user(uid, gid)
        except OSError as exc:
            print(f"unirl tool sandbox: {exc.strerror or exc}", file=sys.stderr, flush=True)
            os._exit(UNAVAILABLE)
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":  # the first process could not finish the isolation
            os._exit(UNAVAILABLE)
        try:
            os.chdir(scratch)
            os.environ.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch)
            _limit(limits)
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"unirl tool sandbox: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) != b"1":
        os.waitpid(tool, 0)
        return UNAVAILABLE
    try:
        _own_proc(libc)
    except OSError as exc:
        print(f"unirl tool sandbox: own /proc: {exc.strerror or exc}", file=sys.stderr, flush=True)
        _kill_all()
        return UNAVAILABLE
    os.write(go_w, b"1")
    _first_in_line()
    return supervise(tool, limits)


def _first_in_line() -> None:
    """The supervisor runs before the server's processes whenever it wakes (real-time priority,
    where the process may take it; else the highest nice): hundreds of forking processes must not
    starve the one that counts them."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | getattr(os, "SCHED_RESET_ON_FORK", 0), os.sched_param(1))
    except OSError:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -20)
        except OSError:
            pass  # an unprivileged supervisor: the kernel's RLIMIT_NPROC holds its server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--cpu-s", type=int, default=Limits.cpu_s)
    parser.add_argument("--memory-mb", type=int, default=Limits.memory_mb)
    parser.add_argument("--files", type=int, default=Limits.files)
    parser.add_argument("--procs", type=int, default=Limits.procs)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    limits = Limits(args.cpu_s, args.memory_mb, args.files, args.procs)
    scratch = os.path.realpath(args.scratch)
    os.makedirs(scratch, exist_ok=True)
    try:
        enter(scratch)
    except OSError as exc:
        print(f"unirl tool sandbox: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return UNAVAILABLE
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os._exit(_namespace_init(scratch, command, limits))
    # outside the namespace: a stop request ends the namespace (its first process, then all of it)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os.kill(child, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    raise SystemExit(main())

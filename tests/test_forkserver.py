"""The suite's fork server (tests/forkserver.py) gives a forked process what a fresh start gives
the code that launched it: a command line `ps` shows, death with the process that asked for it
(as PR_SET_PDEATHSIG), a Popen exit status, and through the proxy torchrun runs, a rank whose exit
and signals are the proxy's; a command whose import-time settings differ from the server's is
refused, so it starts fresh. unirl reaches it only through its launch hook (UNIRL_LAUNCHER)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import forkserver
from tests.conftest import REPO, isolated_env

PROBE = "tests.test_forkserver"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forkserver")
    path = str(tmp / "socket")
    env = {**isolated_env(tmp, forked=False), "TRANSFORMERS_VERBOSITY": "error", **forkserver.env(path)}
    proc = forkserver.start(path, ["json"], env, str(REPO))
    yield path, env
    proc.stdin.close()
    proc.wait(timeout=30)


def probe(*args: str) -> list[str]:
    return [sys.executable, "-m", PROBE, *args]


def test_a_forked_child_shows_its_command_and_its_parent(server):
    path, env = server
    proc = forkserver.popen(path, probe("parent"), env=env, modules=None, stdout=subprocess.PIPE, text=True)
    assert proc is not None
    assert proc.stdout.readline().strip() == str(os.getpid())  # unirl's parent_pid(): the caller, not the server
    cmdline = [a for a in psutil.Process(proc.pid).cmdline() if a]
    assert cmdline == probe("parent")
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_watched_child_dies_with_the_process_that_asked_for_it(server):
    path, env = server
    caller = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tests import forkserver\n"
         f"p = forkserver.popen({path!r}, {probe('sleep')!r}, modules=None, watch=True)\n"
         "print(p.pid, flush=True); time.sleep(600)"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )
    child = psutil.Process(int(caller.stdout.readline()))
    assert child.is_running()
    caller.kill()
    caller.wait(timeout=30)
    child.wait(timeout=30)  # raises TimeoutExpired if it outlived its caller


def test_a_caller_that_goes_away_mid_request_leaves_the_server_serving(server):
    import socket

    path, env = server
    dropped = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dropped.connect(path)
    dropped.close()
    proc = forkserver.popen(path, probe("parent"), env=env, modules=None, stdout=subprocess.DEVNULL)
    assert proc is not None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_setting_read_at_import_that_differs_is_refused(server):
    path, env = server
    assert forkserver.popen(path, probe("parent"), env={**env, "TRANSFORMERS_VERBOSITY": "info"}, modules=None) is None
    assert forkserver.popen(path, probe("parent"), env=env) is None  # not one of the commands unirl forks
    assert forkserver.popen(str(REPO / "no-such-socket"), [sys.executable, "-m", "unirl.stages.workers"], env=env) is None


def test_the_proxy_exits_as_its_command_and_passes_signals_on(server):
    path, env = server
    exec_ = [sys.executable, forkserver.__file__, "--exec", path]
    killed = subprocess.run([*exec_, *probe("kill-self")], cwd=REPO, env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    proxy = subprocess.Popen([*exec_, *probe("sleep")], cwd=REPO, env=env)
    deadline = time.monotonic() + 30
    while not [c for c in psutil.process_iter(["cmdline"]) if (c.info["cmdline"] or [])[:4] == probe("sleep")]:
        assert time.monotonic() < deadline, "the proxied command never started"
        time.sleep(0.05)
    proxy.terminate()
    assert proxy.wait(timeout=30) == -signal.SIGTERM


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "parent":
        from unirl.stages.runtime.processes import parent_pid

        print(parent_pid(), flush=True)
        time.sleep(600)
    elif what == "sleep":
        time.sleep(600)
    elif what == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)

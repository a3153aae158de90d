"""The worker group client: CPU threads per rank, start-up timeouts, and commands sent ahead."""
from __future__ import annotations

import os

import pytest

from stages.workers.group import threads_per_rank


def test_ranks_split_the_cores_and_obey_a_user_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == 8 and threads_per_rank(2) == 4 and threads_per_rank(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. two runs sharing the machine
    assert threads_per_rank(1) == 1 and threads_per_rank(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "32")  # never more than the cores
    assert threads_per_rank(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads_per_rank(2) == 4


def test_a_group_that_is_not_ready_in_time_is_killed_and_the_timeout_reported(tmp_path) -> None:
    """start() past `train.startup_timeout_s`: the error says so (not a refused connection to a
    control port that never opened) and no torchrun process is left behind."""
    from pathlib import Path

    from stages.recipe import load_recipe
    from stages.storage import RunStorage
    from stages.workers.group import WorkerGroup, WorkerGroupDied

    recipe = load_recipe(Path(__file__).parents[3] / "recipes" / "ar" / "tiny.yaml",
                         ["sft=null", f"storage.root={tmp_path}", "train.startup_timeout_s=0.2"])
    group = WorkerGroup(recipe, RunStorage(str(tmp_path), "slow"), init_weights="weights/v000000", log=lambda _: None)
    with pytest.raises(WorkerGroupDied, match="not ready after 0.2s"):
        group.start(None)
    assert group.proc is None and not group.alive()


class FakeRanks:
    """Rank 0's side of the control channel (the real `ControlServer` and wire format) answering
    from a thread, so the client's ordering can be checked without launching torchrun."""

    def __init__(self, token: str):
        import threading

        from stages.workers.control import ControlServer

        self.server = ControlServer(token)
        self.port = self.server.port
        self.seen: list[tuple[str, dict]] = []
        self.version = 3
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        import time

        while True:
            msg = self.server.next_command(idle_s=5)
            if msg["cmd"] == "noop":
                continue
            self.seen.append((msg["cmd"], msg["args"]))
            if msg["cmd"] == "shutdown":
                self.server.reply({"ok": True, "result": {}})
                return
            time.sleep(0.2 if msg["cmd"] == "generate" else 0.0)  # long enough for a later call to queue behind it
            if msg["args"].get("fail"):
                self.server.reply({"ok": False, "error": "Traceback ...\nValueError: bad request"})
                continue
            if msg["cmd"] == "train":
                self.version += 1
            self.server.reply({"ok": True, "result": {"policy_version": self.version, "n": len(self.seen)}})


@pytest.fixture
def fake_group(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from stages.recipe import load_recipe
    from stages.storage import RunStorage
    from stages.workers.group import WorkerGroup

    recipe = load_recipe(Path(__file__).parents[3] / "recipes" / "ar" / "tiny.yaml", ["sft=null", f"storage.root={tmp_path}"])
    group = WorkerGroup(recipe, RunStorage(str(tmp_path), "ahead"), init_weights="weights/v000000", log=lambda _: None)
    ranks = FakeRanks(group.token)
    group.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    group.port, group.version = ranks.port, 3
    yield group, ranks
    group.stop(timeout=0.5)


def test_a_command_sent_ahead_is_answered_once_in_order_and_only_at_the_same_policy_version(fake_group) -> None:
    """sync sends the next iteration's generate ahead: commands issued meanwhile run after it (it
    holds the channel from the moment it is sent); the generate call with the same arguments takes
    its reply instead of sampling twice; after a train step the reply is stale and is sent again."""
    group, ranks = fake_group
    group.prefetch("generate", iteration=3, out_dir="iter-000003/rollouts")
    assert group.call("save")["n"] == 2  # queued behind the generate sent ahead
    first = group.call("generate", iteration=3, out_dir="iter-000003/rollouts")
    assert first == {"policy_version": 3, "n": 1}
    assert [cmd for cmd, _ in ranks.seen] == ["generate", "save"]

    group.prefetch("generate", iteration=4, out_dir="iter-000004/rollouts")
    group.call("train", iteration=3)  # the weights move on: the reply sent ahead no longer holds
    assert group.version == 4
    again = group.call("generate", iteration=4, out_dir="iter-000004/rollouts")
    assert again["policy_version"] == 4
    assert [cmd for cmd, _ in ranks.seen] == ["generate", "save", "generate", "train", "generate"]

    group.prefetch("generate", iteration=4, out_dir="other")  # other arguments: never taken
    assert group.call("generate", iteration=4, out_dir="iter-000004/rollouts")["n"] == 7
    assert len(ranks.seen) == 7


def test_a_command_sent_ahead_that_fails_raises_where_its_reply_is_taken(fake_group) -> None:
    from stages.workers.group import WorkerError

    group, ranks = fake_group
    group.proc.wait = lambda timeout=None: 0  # the real group exits after a failed command; this one stays
    group.prefetch("generate", iteration=3, fail=True)
    with pytest.raises(WorkerError, match="ValueError: bad request"):
        group.call("generate", iteration=3, fail=True)


def test_stopping_while_a_command_sent_ahead_runs_kills_the_group_at_once(fake_group) -> None:
    """Cancelling a run mid-rollout must not wait for the rollout (minutes on a big model) to
    finish before the shutdown command can be sent: the group is killed."""
    group, ranks = fake_group
    group.prefetch("generate", iteration=3)
    group.stop(timeout=30)
    assert group.proc is None and not group.alive()
    assert "shutdown" not in [cmd for cmd, _ in ranks.seen]

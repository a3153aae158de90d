"""Multi-node groups without starting one: the recipe's rules (validate-time, naming the field),
torchrun's rendezvous options, the per-group control token, what rank 0 advertises, and how a
failure is named from the group's records (a lost node before the ranks that only saw it go)."""
from __future__ import annotations

import json
import socket
import uuid

import pytest

from tests.conftest import TINY
from unirl.stages.recipe import RecipeError, load_recipe
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.workers import rendezvous as rdzv
from unirl.stages.workers.agent import open_group, serve_node
from unirl.stages.workers.control import ControlServer, recv_json, send_json


def recipe(*overrides: str):
    return load_recipe(TINY, list(overrides))


def errors(*overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe(*overrides)
    return info.value.errors


def test_old_recipes_with_nproc_keep_working_and_a_conflict_says_what_to_write() -> None:
    from unirl.stages.recipe import build_recipe

    assert recipe("train.nproc=2").train.nproc_per_node == 2  # an override of the old name beats the file's new one
    assert recipe("train.nproc=2").train.world_size == 2
    assert build_recipe({"train": {"nproc": 3}}).train.nproc_per_node == 3
    with pytest.raises(RecipeError) as info:
        build_recipe({"train": {"nproc": 2, "nproc_per_node": 3}}, "old.yaml")
    assert info.value.errors == [
        "train.nproc: 2 is the old name of train.nproc_per_node, which is also given (3); keep only nproc_per_node"]


def test_several_nodes_need_storage_every_node_reads() -> None:
    [local] = errors("train.nnodes=2", "storage.root=runs")
    assert local.startswith("storage.root: 'runs' is a path on this node; with train.nnodes=2 every node reads the run folder")
    assert "storage.shared=true" in local
    assert errors("train.nnodes=2", "storage.root=memory://x")[0].startswith("storage.root: memory:// lives in one process")
    assert recipe("train.nnodes=2", "storage.root=/mnt/nfs/runs", "storage.shared=true").storage.shared
    two = recipe("train.nnodes=2", "train.nproc_per_node=4", "storage.root=s3://bucket/runs")
    assert two.train.world_size == 8
    assert recipe("storage.root=runs").train.nnodes == 1  # one node: a local path is fine


def test_node_settings_are_checked_field_by_field() -> None:
    found = errors("train.nnodes=2", "storage.root=s3://b/r", "train.min_nnodes=3", "train.rendezvous.endpoint=node:http",
                   "train.agents.deployment=node-agent", "train.agents.work_queues=[a, b]")
    assert [e.split(":")[0] for e in found] == ["train.min_nnodes", "train.rendezvous.endpoint", "train.agents.deployment",
                                               "train.agents.work_queues"]
    assert errors("train.agents.flow_host=false")[0].startswith("train.agents.flow_host: a one-node group runs on the flow's host")
    assert errors("train.agents.work_queues=[a]", "train.nnodes=2", "storage.root=s3://b/r")[0].startswith(
        "train.agents.work_queues: only used with train.agents.deployment")
    ok = recipe("train.nnodes=3", "storage.root=s3://b/r", "train.agents.flow_host=false", "train.agents.deployment=node-agent/x",
                "train.agents.work_queues=[h1, h2, h3]", "train.rendezvous.endpoint=node-0.svc")
    assert ok.train.agents.work_queues == ["h1", "h2", "h3"]


def test_where_and_how_many_nodes_run_is_not_part_of_the_run_fingerprint() -> None:
    """A checkpoint of a 2-node run resumes on one node (and back): DCP reshards."""
    one = recipe("storage.root=s3://b/r")
    moved = recipe("storage.root=s3://b/r", "train.nnodes=4", "train.nproc_per_node=8", "train.min_nnodes=2",
                   "train.rendezvous.endpoint=h:1", "train.rendezvous.last_call_s=5", "train.agents.flow_host=false",
                   "train.agents.deployment=node-agent/x", "storage.shared=true")
    assert one.fingerprint() == moved.fingerprint()
    assert one.fingerprint() != recipe("storage.root=s3://b/r", "train.lr=0.5").fingerprint()


def test_the_rendezvous_options_torchrun_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = RunStorage(f"memory://rdzv-{uuid.uuid4().hex}", "r")
    r = recipe("storage.root=s3://b/r", "train.nnodes=2", "train.nproc_per_node=4", "train.startup_timeout_s=90")
    monkeypatch.delenv(rdzv.RDZV_ENV, raising=False)
    with pytest.raises(rdzv.NodeSetupError, match="set train.rendezvous.endpoint .* or \\$UNIRL_RDZV_ENDPOINT"):
        rdzv.new_group(storage, r, "run-id")
    monkeypatch.setenv(rdzv.RDZV_ENV, "node-0.example")
    plan = rdzv.new_group(storage, r, "0123456789abcdef0123")
    assert storage.read_json(rdzv.CURRENT) == {"group": plan.group}
    assert rdzv.read_plan(storage, plan.group) == plan
    assert plan.endpoint == "node-0.example:29400" and plan.rdzv_id == f"0123456789abcdef-{plan.group}"
    args = plan.torchrun_args()
    assert args[:4] == ["--nnodes", "2", "--nproc-per-node", "4"]
    assert args[args.index("--rdzv-backend") + 1] == "c10d" and args[args.index("--max-restarts") + 1] == "0"
    assert args[args.index("--rdzv-conf") + 1] == "join_timeout=90,last_call_timeout=30"
    elastic = recipe("storage.root=s3://b/r", "train.nnodes=4", "train.min_nnodes=2", "train.rendezvous.last_call_s=5",
                     "train.rendezvous.endpoint=10.0.0.1:1234")
    plan = rdzv.new_group(storage, elastic, "x")
    assert plan.torchrun_args()[:2] == ["--nnodes", "2:4"] and plan.endpoint == "10.0.0.1:1234"
    assert plan.torchrun_args()[-1] == "join_timeout=300,last_call_timeout=5"
    assert rdzv.new_group(storage, elastic, "x").group != plan.group  # every launch is its own rendezvous


def test_a_group_needs_the_shared_secret_and_its_token_opens_only_that_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rdzv.SECRET_ENV, raising=False)
    with pytest.raises(rdzv.NodeSetupError, match="set UNIRL_CONTROL_SECRET to the same secret on the flow's host and on every node"):
        rdzv.control_secret(2)
    a = rdzv.group_token("s", "g1")
    assert a == rdzv.group_token("s", "g1") and len(a) == 64
    assert a != rdzv.group_token("s", "g2") and a != rdzv.group_token("t", "g1")
    import hashlib
    import hmac

    assert a == hmac.new(b"s", b"g1", hashlib.sha256).hexdigest()


def test_rank_zero_listens_on_every_interface_and_serves_only_its_groups_token() -> None:
    """At several nodes the flow may be on another host; another group's token (or a guess) is refused."""
    import threading

    assert rdzv.bind_address() == "0.0.0.0"

    token = rdzv.group_token("secret", "g")
    server = ControlServer(token, host=rdzv.bind_address())
    replies = []

    def client() -> None:
        for t in (rdzv.group_token("secret", "other-group"), token):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                send_json(sock, {"token": t, "cmd": "ping", "args": {}})
                if t == token:
                    replies.append(("served", None))
                    recv_json(sock)
                else:
                    replies.append(("refused", recv_json(sock)))

    th = threading.Thread(target=client)
    th.start()
    try:
        assert server.next_command(idle_s=10) == {"cmd": "ping", "args": {}}
        server.reply({"ok": True, "result": {}})
    finally:
        th.join(timeout=10)
        server.close()
    assert replies[0] == ("refused", {"ok": False, "error": "unauthorized: wrong or missing control token"})
    assert replies[1][0] == "served"


def test_rank_zero_advertises_the_address_the_flow_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rdzv.HOST_ENV, raising=False)
    assert rdzv.advertised_host("127.0.0.1:29400") == "127.0.0.1"  # the route toward the rendezvous
    monkeypatch.setenv(rdzv.HOST_ENV, "10.1.2.3")  # Kubernetes: the pod IP from the downward API
    assert rdzv.advertised_host("svc:29400") == "10.1.2.3"


def records(nodes: int = 2) -> tuple[RunStorage, str, dict]:
    storage = RunStorage(f"memory://failures-{uuid.uuid4().hex}", "r")
    ready = {"ranks": [{"rank": k, "local_rank": 0, "node": k, "host": f"host-{k}", "pid": 100 + k, "agent_pid": 10 + k}
                       for k in range(nodes)]}
    return storage, "g", ready


def agent_record(storage: RunStorage, host: str, pid: int, **fields) -> None:
    storage.write_json(rdzv.group_rel("g", f"ended/{host}-{pid}.json"), {"host": host, "pid": pid, **fields})


def test_a_node_that_left_no_word_is_named_lost_not_the_rank_that_saw_it_go() -> None:
    storage, group, ready = records()
    # Node 0 (the flow's host): rank 0's collective broke, torchrun reports it with exit code 1.
    storage.write_json(rdzv.group_rel(group, "exits/rank-00000.json"), {"rank": 0, "status": "error", "host": "host-0",
                       "pid": 100, "error": "RuntimeError: Connection closed by peer [127.0.0.1]:9136"})
    local = (10, "rank 0 (local rank 0, pid 100) exited with exit code 1")
    kind, text = rdzv.name_failure(storage, group, ready, local, wait_s=0)
    assert kind == "lost"
    assert text == ("node 1 (host host-1, torchrun agent pid 11) was lost: rank 1 (local rank 0, pid 101) and its agent "
                    "left no word within 0s (the agent or the host died)")
    assert rdzv.failing(storage, group)


def test_a_rank_killed_on_another_node_is_named_with_its_node() -> None:
    storage, group, ready = records()
    agent_record(storage, "host-1", 11, state="exited", exit_code=1,
                 failure="rank 1 (local rank 0, pid 101) exited with signal SIGKILL")
    storage.write_json(rdzv.group_rel(group, "exits/rank-00000.json"), {"rank": 0, "status": "error", "host": "host-0",
                       "pid": 100, "error": "Traceback ...\nRuntimeError: Connection closed by peer"})
    kind, text = rdzv.name_failure(storage, group, ready, (10, "rank 0 (local rank 0, pid 100) exited with exit code 1"), wait_s=0)
    assert (kind, text) == ("signal", "rank 1 (local rank 0, pid 101) exited with signal SIGKILL on node 1 (host host-1)")


def test_a_rank_that_raised_is_an_error_with_its_last_line() -> None:
    storage, group, ready = records()
    for k in range(2):
        storage.write_json(rdzv.group_rel(group, f"exits/rank-{k:05d}.json"), {"rank": k, "status": "error", "host": f"host-{k}",
                           "pid": 100 + k, "error": "Traceback (most recent call last):\n  ...\nValueError: bad shard x.arrow\n"})
    agent_record(storage, "host-1", 11, state="exited", exit_code=1, failure="rank 1 (local rank 0, pid 101) exited with exit code 1")
    kind, text = rdzv.name_failure(storage, group, ready, (10, ""), wait_s=0)
    assert (kind, text) == ("error", "rank 0 (host host-0, pid 100) failed: ValueError: bad shard x.arrow")
    assert not rdzv.failing(RunStorage(f"memory://quiet-{uuid.uuid4().hex}", "r"), "g")


def test_an_agent_joins_only_an_open_group_of_the_same_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = RunStorage(f"memory://agent-{uuid.uuid4().hex}", "r")
    r = recipe("storage.root=s3://b/r", "train.nnodes=2", "train.rendezvous.endpoint=127.0.0.1:1", "train.startup_timeout_s=1")
    with pytest.raises(rdzv.NodeSetupError, match="no worker group of run 'r' to join .* within 1s: start \\(or rerun\\) the run"):
        open_group(storage, 1)
    plan = rdzv.new_group(storage, r, "id")
    assert open_group(storage, 1) == plan.group
    other = recipe("storage.root=s3://b/r", "train.nnodes=2", "train.lr=0.5")
    with pytest.raises(rdzv.NodeSetupError, match="started with another recipe than this agent's"):
        serve_node(storage, other, group=plan.group)
    with pytest.raises(rdzv.NodeSetupError, match="train.nnodes is 1: the run's own host is its only node"):
        serve_node(storage, recipe(), group=plan.group)
    storage.write_json(rdzv.group_rel(plan.group, "ready.json"), {"ranks": []})
    with pytest.raises(rdzv.NodeSetupError, match="has already started"):
        serve_node(storage, r, group=plan.group)
    with pytest.raises(rdzv.NodeSetupError, match="no worker group"):
        open_group(storage, 0)  # the newest group started already: nothing to join


def test_a_rank_reads_its_spec_from_run_storage_with_its_own_node_settings(tmp_path) -> None:
    from unirl.stages.workers.__main__ import wait_for_spec

    storage = RunStorage(str(tmp_path / "runs"), "r")
    r = recipe(f"storage.root={tmp_path / 'runs'}", "storage.shared=true", "train.nnodes=2",
               "train.rendezvous.endpoint=127.0.0.1:1")
    plan = rdzv.new_group(storage, r, "id")
    storage.write_json(rdzv.group_rel(plan.group, "spec.json"), {"checkpoint": 3, "scratch": "/flow/host/tmp", "threads_per_rank": 8})
    pointer = tmp_path / "node.json"
    pointer.write_text(json.dumps(rdzv.node_pointer(storage, plan, tmp_path / "scratch", 2)))
    spec = wait_for_spec(pointer)
    assert spec["checkpoint"] == 3 and spec["group"] == plan.group and spec["endpoint"] == "127.0.0.1:1"
    assert spec["scratch"] == str(tmp_path / "scratch") and spec["threads_per_rank"] == 2


def test_an_agent_on_a_shared_mount_that_sees_no_group_doubts_the_mount(tmp_path) -> None:
    """`storage.shared` is the user's word that a local root is one filesystem on every node: an
    agent that finds no announced group there says that this is what to check."""
    root = tmp_path / "runs"
    r = recipe(f"storage.root={root}", "storage.shared=true", "train.nnodes=2", "train.rendezvous.endpoint=127.0.0.1:1",
               "train.startup_timeout_s=0.1")
    with pytest.raises(rdzv.NodeSetupError, match=f"storage.shared is set: {root / 'r'} must be the same mounted filesystem"):
        serve_node(RunStorage(str(root), "r"), r)

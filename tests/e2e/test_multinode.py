"""Worker groups of two nodes on one machine: two torchrun agents (`--nnodes 2`, one rank each, a
c10d rendezvous on 127.0.0.1, gloo), the run folder on moto's S3 server.

* The tiny AR recipe through `unirl run` against the session's Prefect server: the run starts the
  second node's agent through the `node-agent/tiny-2node` deployment on a process worker. That
  node is lost mid-train (its agents and rank SIGKILLed): the train task fails naming the node
  and rank, and its retry starts a new group of two nodes (the agent launched again through
  Prefect) that resumes from the last checkpoint; the sampled texts, train metrics and final
  weights equal a one-node world-size-2 run's.
* The tiny SD3 recipe at the worker-group level, its second agent started by hand (`unirl agent`):
  the same latents and final weights as one node with two ranks; then an elastic group whose
  second node never comes resumes the 2-node checkpoint on one node.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import s3fs

from tests import forkserver, zygote
from tests.conftest import REPO, TINY, run_unirl
from tests.e2e.test_rl_flow import SIGNAL
from tests.moto_s3 import moto_endpoint

pytestmark = pytest.mark.slow

SECRET = {"UNIRL_CONTROL_SECRET": "multinode-test-secret"}
BUCKET = "unirl-multinode"


def rdzv_port() -> int:
    """A free port below the ephemeral range (as torchrun's default 29400 is): a port from that
    range can be taken by any outgoing connection on a busy machine before the agent binds it,
    and then no agent hosts the rendezvous store."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture(scope="module")
def s3():
    with moto_endpoint() as url:
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": url})
        fs.mkdir(BUCKET)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": url}
        yield fs, env


def read_table(fs: s3fs.S3FileSystem, path: str) -> pa.Table:
    with fs.open(path, "rb") as fh:
        return ipc.open_file(pa.py_buffer(fh.read())).read_all()


def rollouts(fs: s3fs.S3FileSystem, run: str, iteration: int, column: str) -> dict[str, object]:
    """sample_id -> `column` of every rollout shard of an iteration."""
    fs.invalidate_cache()
    out: dict[str, object] = {}
    for path in sorted(fs.ls(f"{BUCKET}/{run}/iter-{iteration:06d}/rollouts")):
        table = read_table(fs, path)
        out.update(zip(table.column("sample_id").to_pylist(), table.column(column).to_pylist()))
    return out


def weights_sha(fs: s3fs.S3FileSystem, run: str, version: int) -> dict[str, str]:
    manifest = json.loads(fs.cat(f"{BUCKET}/{run}/weights/v{version:06d}/manifest.json"))
    return {name: f["sha256"] for name, f in manifest["files"].items() if name.endswith(".safetensors")}


def train_metrics(fs: s3fs.S3FileSystem, run: str, iteration: int) -> dict[str, float]:
    metrics = json.loads(fs.cat(f"{BUCKET}/{run}/iter-{iteration:06d}/train.json"))["metrics"]
    return {k: v for k, v in metrics.items() if k != "seconds"}


@pytest.fixture(scope="module")
def node_pool(prefect_server, s3):
    """A process work pool of its own on the session's server, the shipped `node-agent/tiny-2node`
    deployment on it, and `start(env)`: a worker for it (the second node's host) with `env`."""
    _, s3_env = s3
    env = {**prefect_server.env, **s3_env, **SECRET}
    prefect_server.cli("work-pool", "create", "mn-nodes", "--type", "process", env=env)
    # The node's flow run starts fresh under the worker; its torchrun agent and ranks are forked
    # warm (tests/zygote.py), as the flow host's are.
    env = {**env, **zygote.import_env(), **forkserver.env(zygote.server().path)}
    prefect_server.cli("--no-prompt", "deploy", "--name", "node-agent/tiny-2node", "--pool", "mn-nodes", env=env, timeout=300)
    workers: list[subprocess.Popen] = []

    def start(extra: dict[str, str]) -> None:
        for w in workers:
            prefect_server.stop(w)
        workers.clear()
        workers.append(prefect_server.start("mn-worker", "worker", "start", "--pool", "mn-nodes", "--type", "process",
                                            env={**env, **extra}))

    yield start
    for w in workers:
        prefect_server.stop(w)


def test_two_nodes_through_prefect_equal_one_node_and_a_lost_node_is_named_and_rejoined(s3, node_pool, unirl_env, tmp_path):
    fs, s3_env = s3
    env = {**unirl_env, **s3_env, **SECRET}
    common = [f"storage.root=s3://{BUCKET}", SIGNAL, "sft=null", "eval.enabled=false", "checkpoint_every=1",
              "train.micro_batch_size=4"]
    # One node, two ranks: the reference.
    run_unirl(["run", str(TINY), "iterations=2", *common, "train.nproc_per_node=2", "--run-name", "ref"], env)

    # Two nodes; the second (the process worker's host) is lost as iteration 1's update starts, once.
    node_pool({"UNIRL_FAULTS": "train-node@1", "UNIRL_FAULTS_ONCE": str(tmp_path / "node-lost")})
    two_nodes = [*common, "train.nnodes=2", "train.nproc_per_node=1", f"train.rendezvous.endpoint=127.0.0.1:{rdzv_port()}",
                 "train.agents.deployment=node-agent/tiny-2node", "--run-name", "mn"]
    out = run_unirl(["run", str(TINY), "iterations=2", *two_nodes], env)
    said = out.stdout + out.stderr
    # The iteration's train task fails naming the node and its rank ...
    lost = re.search(r"worker node \d \(host [^,]+, torchrun agent pid \d+\) was lost: rank \d \(local rank 0, pid \d+\) "
                     r"and its agent left no word within \d+s \(the agent or the host died\) during 'train'", said)
    assert lost and (tmp_path / "node-lost").exists(), said[-6000:]
    # ... and its retry launches a new group (the run starts the node's agent again), which restores
    # checkpoint 1 and trains iteration 1 once.
    assert "starting worker group: 2 node(s) x 1 rank(s), checkpoint 1" in out.stdout, out.stdout
    assert out.stdout.count("[unirl] iter-000001 (2/2)") == 1
    for i in range(2):
        assert rollouts(fs, "mn", i, "text") == rollouts(fs, "ref", i, "text"), f"iteration {i}: other samples"
        assert train_metrics(fs, "mn", i) == train_metrics(fs, "ref", i), f"iteration {i}: another update"
    assert weights_sha(fs, "mn", 2) == weights_sha(fs, "ref", 2)
    ready = [json.loads(fs.cat(p)) for p in fs.glob(f"{BUCKET}/mn/workers/*/ready.json")]
    assert [len({r["node"] for r in x["ranks"]}) for x in ready] == [2, 2], "two groups of two nodes: the lost one, the retry's"


def group_iterations(group, storage, recipe, iterations: range, train: bool = True) -> None:
    """What a flow run's stages do with the group, iteration by iteration (tests/stages/test_matrix.py)."""
    from unirl.stages.run import iteration as it

    for i in iterations:
        requests = it.write_requests(storage, recipe, i)["files"][0]
        gen = group.call("generate", iteration=i, requests=requests, out_dir=f"iter-{i:06d}/rollouts")
        if not train:
            continue
        scored = it.score(storage, recipe, i, gen["files"])
        adv = it.advantages(storage, recipe, i, scored["files"])
        group.call("train", iteration=i, rollouts=gen["files"], advantages=adv["files"][0])
        group.call("save")
    group.call("publish")


def test_sd3_on_two_nodes_started_by_hand_equals_one_node_and_resumes_on_fewer_nodes(s3, tmp_path, monkeypatch, forked_children):
    """The second agent is `unirl agent` (plain hosts, started by hand); the SD3 latents of both
    iterations and the final weights equal one node's with two ranks. Then an elastic group
    (train.min_nnodes=1) whose second node never comes starts on one node from the 2-node
    checkpoint and samples what the reference samples next."""
    from tests.tiny import TINY as TINY_RECIPES
    from tests.tiny import merged
    from unirl.stages.recipe import build_recipe
    from unirl.stages.run.record import initial_weights
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.group import WorkerGroup

    fs, s3_env = s3
    for key, value in {**s3_env, **SECRET}.items():
        monkeypatch.setenv(key, value)
    port = rdzv_port()

    def recipe_of(**train):
        return build_recipe(merged(TINY_RECIPES["sd3"], {"name": "sd3-nodes", "algorithm": {"name": "flow_grpo"}, "storage": {"root": f"s3://{BUCKET}/sd3"},
                                                         "train": {"rendezvous": {"endpoint": f"127.0.0.1:{port}"}, **train}}))

    def group_for(recipe, run):
        storage = RunStorage(recipe.storage.root, run)
        return WorkerGroup(recipe, storage, init_weights=initial_weights(storage, recipe), log=lambda _: None), storage

    def latents(run, i):
        return {k: list(v) for k, v in rollouts(fs, f"sd3/{run}", i, "latents").items()}

    ref = recipe_of(nproc_per_node=2)
    group, storage = group_for(ref, "ref")
    try:
        group.start(None)
        group_iterations(group, storage, ref, range(2))
        group_iterations(group, storage, ref, range(2, 3), train=False)  # what version 2 samples next
    finally:
        group.stop()

    two = recipe_of(nnodes=2, nproc_per_node=1)
    group, storage = group_for(two, "mn")
    path = tmp_path / "sd3-nodes.yaml"
    path.write_text(two.to_yaml())
    group.prewarm()
    agent = zygote.popen([sys.executable, "-m", "unirl.flows.cli", "agent", str(path), "--run-name", "mn"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        group.start(None)
        assert group.ready["world_size"] == 2 and len({r["node"] for r in group.ready["ranks"]}) == 2
        group_iterations(group, storage, two, range(2))
    finally:
        group.stop()
        out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, out[-3000:]
    for i in range(2):
        assert latents("mn", i) == latents("ref", i), f"iteration {i}: other latents"
    assert weights_sha(fs, "sd3/mn", 2) == weights_sha(fs, "sd3/ref", 2)

    # Elastic: one or two nodes; only this host's agent comes, so after last_call_s it runs alone.
    elastic = recipe_of(nnodes=2, min_nnodes=1, nproc_per_node=1, rendezvous={"endpoint": f"127.0.0.1:{port}", "last_call_s": 1})
    group, storage = group_for(elastic, "mn")
    try:
        group.start(2)
        assert group.ready["world_size"] == 1 and group.version == 2
        group_iterations(group, storage, elastic, range(2, 3), train=False)
    finally:
        group.stop()
    # One rank samples the whole batch where two ranks sampled halves: the same weights give the
    # same latents up to batched-kernel rounding (a checkpoint restored wrong is off by O(1)).
    mine, ref_next = latents("mn", 2), latents("ref", 2)
    assert sorted(mine) == sorted(ref_next)
    for sample in mine:
        np.testing.assert_allclose(mine[sample], ref_next[sample], rtol=0, atol=1e-4, err_msg=sample)

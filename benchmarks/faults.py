"""The fault table: what a user sees when something breaks under a run, and whether the resumed
run ends exactly where an uninterrupted one does (per-iteration metrics, MLflow history, final
weights' sha256).

    python benchmarks/faults.py                  # every row, each fault in a fresh run folder
    python benchmarks/faults.py --rows kill      # only the SIGKILL rows

Faults are real: SIGKILL of `unirl run` at a point named in UNIRL_FAULTS (stages/runtime/faults.py: the
stage's work done, its output not committed), a worker rank killed, moto's S3 server stopped
and started again, a full tmpfs, a checkpoint file corrupted or its commit marker removed, a
reward server that comes up late, the same run started twice, a node of a two-node group lost
(its `unirl agent`, torchrun agent and rank SIGKILLed mid-train). tests/e2e/test_faults_*.py run the
same rows at tiny size (the SIGKILL rows chained in one run folder). Every run a row resumes (and
each killed one of the chain) is audited too (`unirl audit`, stages/run/audit.py: each group
trained once, within the staleness bound, weights matching their manifests, the behaviour check
held); a violation fails the row.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ar" / "quickstart.yaml"
# A small SFT then 4 GRPO iterations; checkpoints after iterations 1 and 3, held-out evaluation
# before and after RL: every stage a kill can land in runs.
TINY = ["sft.steps=4", "sft.examples=64", "sft.batch_size=16", "rollout.prompts_per_iteration=4", "rollout.group_size=4",
        "iterations=3", "checkpoint_every=2", "data.heldout_size=4", "eval.k=2"]
ITERATIONS = 3
NO_SFT = ["sft=null"]  # rows that need no warm start skip it (one worker group start less per run)
# How `unirl` commands start: as fresh interpreters; the test suite forks them from a warm one
# instead (tests/zygote.py, set in tests/e2e/faults_bench.py).
popen, run_command = subprocess.Popen, subprocess.run
# (row, UNIRL_FAULTS): the SIGKILL rows, in the order a run reaches them.
KILLS = [
    ("SIGKILL in SFT", "sft"),
    ("SIGKILL in generate", "generate@1"),
    ("SIGKILL in score", "score@1"),
    ("SIGKILL in advantage", "advantage@1"),
    ("SIGKILL in train", "train@1"),
    ("SIGKILL in checkpoint write", "checkpoint@2"),
    ("SIGKILL in sync (checkpoint + publish done, not committed)", "sync@1"),
    ("SIGKILL after a commit, before its MLflow report (the run loop's bookkeeping)", "report@1"),
    ("SIGKILL in held-out evaluation", "evaluate@3"),
]


@dataclass
class Row:
    fault: str
    seen: str
    equal: bool | None

    def line(self) -> str:
        mark = {True: "yes", False: "NO", None: "n/a"}[self.equal]
        return f"| {self.fault} | {self.seen} | {mark} |"


def unirl(args: list[str], env: dict[str, str], check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = run_command([sys.executable, "-m", "unirl.flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"unirl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_args(root: Path, name: str, extra: Sequence[str] = ()) -> list[str]:
    return ["run", str(RECIPE), f"storage.root={root}", "--run-name", name, *TINY, *extra]


def notable(out: str) -> str:
    """What a resumed run says about the fault it recovers from."""
    keys = ("replaying", "had not logged", "not usable", "taking over", "unreachable", "resum", "starting worker group: 1 rank(s), checkpoint")
    lines = [ln.removeprefix("[unirl] ") for ln in out.splitlines() if any(k in ln for k in keys)]
    return "; ".join(dict.fromkeys(lines))[:300] or "resumes silently: every committed stage is reused"


# -- comparing a run with the uninterrupted one ----------------------------------------------------------


def mlflow_history(run_dir: Path, env: dict[str, str]) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    uri = env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.parent / 'mlflow.db'}"  # the storage root's store
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    keys = client.get_run(run_id).data.metrics.keys()
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys
            if not k.startswith(("time/", "system/"))}  # seconds and the machine's load: never equal twice


def snapshot(run_dir: Path, env: dict[str, str], iterations: int, version: int | None = None) -> dict[str, Any]:
    """What a run ended with: per-iteration metrics, MLflow history, and the sha256 of its weights
    `version` (default `iterations`: one update per iteration)."""
    def clean(metrics: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in metrics.items() if not k.startswith("time/") and k != "seconds"}

    out: dict[str, Any] = {"iterations": [], "mlflow": mlflow_history(run_dir, env)}
    for i in range(iterations):
        d = run_dir / f"iter-{i:06d}"
        out["iterations"].append({"success": clean(json.loads((d / "_SUCCESS").read_text())["metrics"]),
                                  "train": clean(json.loads((d / "train.json").read_text())["metrics"])})
    manifest = json.loads((run_dir / f"weights/v{iterations if version is None else version:06d}/manifest.json").read_text())["files"]
    out["weights"] = {k: v["sha256"] for k, v in manifest.items()}
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for i, (x, y) in enumerate(zip(a["iterations"], b["iterations"])):
        out += [f"iteration {i} {part}" for part in ("success", "train") if x[part] != y[part]]
    out += [f"MLflow {k}" for k in sorted(set(a["mlflow"]) | set(b["mlflow"])) if a["mlflow"].get(k) != b["mlflow"].get(k)]
    if a["weights"] != b["weights"]:
        out.append("final weights")
    return out


class Bench:
    """A work folder, the environment every run gets, the uninterrupted reference runs, and the
    audits of the runs the rows resumed (`audits`: run URL -> its violations, in order)."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.work, self.env = work, env
        self._refs: dict[str, dict[str, Any]] = {}
        self.audits: list[tuple[str, list[str]]] = []

    def audit(self, run_dir: Path | str, options: dict[str, Any] | None = None) -> list[str]:
        """`unirl audit` of a run folder (a path, or a URL with its storage options), in this
        process; its violations, recorded in `audits`."""
        from unirl.stages.run.audit import audit_run, resolve

        storage = resolve(str(run_dir), options=options)
        violations = audit_run(storage).violations
        self.audits.append((storage.url(), violations))
        return violations

    def reference(self, key: str = "", extra: Sequence[str] = (), iterations: int = ITERATIONS) -> dict[str, Any]:
        if key not in self._refs:
            root = self.work / f"reference{key}"
            unirl(run_args(root, "ref", list(extra)), self.env)
            self._refs[key] = snapshot(root / "ref", self.env, iterations)
        return self._refs[key]

    def equal(self, run_dir: Path, key: str = "", extra: Sequence[str] = (), iterations: int = ITERATIONS) -> tuple[bool, list[str]]:
        """Whether the resumed run in `run_dir` ends where the reference does and passes its audit;
        what differs (an audit's violations as `audit: ...`)."""
        diffs = differences(snapshot(run_dir, self.env, iterations), self.reference(key, extra, iterations))
        diffs += [f"audit: {v}" for v in self.audit(run_dir)]
        return not diffs, diffs


# -- the rows ---------------------------------------------------------------------------------------------


def kill_rows(bench: Bench, chained: bool) -> list[Row]:
    """Each SIGKILL row: the run is killed at the point, then the same command resumes it. Chained:
    one run folder takes every kill in turn, then finishes (one comparison for all)."""
    rows = []
    root = bench.work / "kills"
    for fault, spec in KILLS:
        name = "chain" if chained else spec.replace("@", "-")
        killed = unirl(run_args(root, name), {**bench.env, "UNIRL_FAULTS": spec}, check=False)
        if killed.returncode != -signal.SIGKILL:
            raise RuntimeError(f"{spec}: the run was not killed at its fault point (exit {killed.returncode}):\n{killed.stderr[-3000:]}")
        seen = "the run vanishes (exit -9); the same command resumes: "
        if chained:
            audited = bench.audit(root / name)  # a run cut short: what it committed must audit clean
            rows.append(Row(fault, seen, False if audited else None))
            if audited:
                print(f"  {fault}: the killed run's audit: {audited}", file=sys.stderr)
            continue
        resumed = unirl(run_args(root, name), bench.env)
        same, diffs = bench.equal(root / name)
        rows.append(Row(fault, seen + notable(resumed.stdout), same if same else False))
        if diffs:
            print(f"  {fault}: differs in {diffs}", file=sys.stderr)
    if chained:
        resumed = unirl(run_args(root, "chain"), bench.env)
        same, diffs = bench.equal(root / "chain")
        for row in rows:
            row.seen += "(chained) " + notable(resumed.stdout)
            row.equal = same and row.equal is None
        if diffs:
            print(f"  chained kills: differs in {diffs}", file=sys.stderr)
    return rows


def checkpoint_rows(bench: Bench) -> list[Row]:
    """The newest checkpoint without its commit marker and the one before it with a corrupted
    shard: the run says why it passes over each, restores the newest good state (here the initial
    weights) and replays the train steps after it."""
    root = bench.work / "ckpt"
    extra = [*NO_SFT, "checkpoint_every=1"]
    # Killed as the last iteration starts, after checkpoints 000001 and 000002 were written.
    killed = unirl(run_args(root, "r", extra), {**bench.env, "UNIRL_FAULTS": f"generate@{ITERATIONS - 1}"}, check=False)
    if killed.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the run was not killed before its last iteration (exit {killed.returncode}):\n{killed.stderr[-3000:]}")
    (root / "r" / "checkpoints" / "000002" / "_COMMITTED").unlink()
    shard = next(p for p in sorted((root / "r" / "checkpoints" / "000001" / "state").rglob("*.safetensors")))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = unirl(run_args(root, "r", extra), bench.env)
    same, diffs = bench.equal(root / "r", key="-nosft-every1", extra=extra)
    if diffs:
        print(f"  checkpoints: differs in {diffs}", file=sys.stderr)
    said = notable(resumed.stdout)
    out = resumed.stdout
    ok = same and "000002 is not usable: it was never committed" in out and "000001 is not usable" in out and "corrupted" in out
    return [Row("checkpoint without its commit marker; the one before it with a corrupted shard", said, ok)]


def rank_row(bench: Bench) -> Row:
    """One worker rank killed mid-train at world size 2: the run fails naming the rank (its error is
    the first thing on stderr: Prefect's tracebacks are in the log file); the rerun resumes."""
    root = bench.work / "rank"
    extra = [*NO_SFT, "train.nproc=2", "train.micro_batch_size=8"]
    failed = unirl(run_args(root, "r", extra), {**bench.env, "UNIRL_FAULTS": "train-rank1@1"}, check=False)
    said = next((ln for ln in failed.stderr.splitlines() if ln.startswith("error:")), failed.stderr[-300:])
    if failed.returncode != 1 or "rank 1 (local rank 1" not in said or not failed.stderr.startswith("error: "):
        raise RuntimeError(f"a killed rank must fail the run naming it:\n{failed.stderr[-3000:]}")
    unirl(run_args(root, "r", extra), bench.env)
    same, _ = bench.equal(root / "r", key="-ws2", extra=extra)
    return Row("worker rank 1 killed mid-train (world size 2)", said[:200] + "; rerun resumes", same)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_row(bench: Bench) -> Row:
    """A two-node group (two agents on this machine, c10d on 127.0.0.1, the run folder shared):
    the second node is lost as iteration 1's update starts, in the group and in the train task's
    retry; the run fails naming the node and rank. The rerun's group (its second node back)
    resumes from the last checkpoint and ends where one node with two ranks does. The second
    node's agents are started for every group the run announces, as the node-agent deployment
    would (`unirl agent --group`)."""
    import threading

    root = bench.work / "node"
    port = 29400 + os.getpid() % 500  # below the ephemeral range: no outgoing connection takes it first
    extra = [*NO_SFT, "train.nnodes=2", "train.nproc_per_node=1", "train.micro_batch_size=8", "storage.shared=true",
             f"train.rendezvous.endpoint=127.0.0.1:{port}"]
    env = {**bench.env, "UNIRL_CONTROL_SECRET": "fault-table-secret"}
    args = run_args(root, "r", extra)

    def serve_groups(stop: threading.Event, faulty: bool) -> None:
        seen: set[str] = set()
        current = root / "r" / "workers" / "current.json"
        while not stop.is_set():
            group = json.loads(current.read_text())["group"] if current.exists() else None
            if group and group not in seen:
                seen.add(group)
                agent_env = {**env, "UNIRL_FAULTS": "train-node@1"} if faulty else env
                popen([sys.executable, "-m", "unirl.flows.cli", "agent", str(RECIPE), *args[2:], "--group", group],
                      cwd=REPO, env=agent_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)

    said, resumed = "", None
    for faulty in (True, False):
        stop = threading.Event()
        agents = threading.Thread(target=serve_groups, args=(stop, faulty), daemon=True)
        agents.start()
        try:
            out = unirl(args, env, check=not faulty)
        finally:
            stop.set()
            agents.join()
        if faulty:
            said = next((ln for ln in out.stderr.splitlines() if ln.startswith("error:")), out.stderr[-300:])
            if out.returncode != 1 or "was lost" not in said:
                raise RuntimeError(f"a lost node must fail the run naming it:\n{out.stderr[-3000:]}")
        else:
            resumed = out
    same, diffs = bench.equal(root / "r", key="-ws2", extra=[*NO_SFT, "train.nproc=2", "train.micro_batch_size=8"])
    if diffs:
        print(f"  node lost: differs in {diffs}", file=sys.stderr)
    assert resumed is not None
    return Row("a node of a 2-node group lost mid-train (its agents and rank SIGKILLed)",
               said.removeprefix("error: ")[:220] + "; rerun: " + notable(resumed.stdout), same)


def s3_row(bench: Bench) -> Row:
    """moto's S3 stopped for 10 s mid-run and started again: storage calls retry with backoff and
    the run completes; meanwhile the same run started again on S3 is refused, naming the owner.
    The run stops itself (SIGSTOP) once iteration 1's rollouts are written, before it commits
    them: the second start meets a run that cannot have finished (before, a loaded machine could
    start it after the run's end), and the run goes on (SIGCONT) as S3 goes down. botocore's
    own retries may ride out the 10 s unseen ("no call met the outage")."""
    import psutil
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {**bench.env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url}
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": url})
    bucket = f"faults-{os.getpid()}"
    fs.mkdir(bucket)
    root = f"s3://{bucket}/runs"
    args = run_args(root, "r", NO_SFT)  # type: ignore[arg-type]
    proc = popen([sys.executable, "-m", "unirl.flows.cli", *args], cwd=REPO, env={**env, "UNIRL_FAULTS": "generate@1:stop"},
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the S3 run never reached iteration 1's commit: {proc.communicate()[1][-3000:]}")
            time.sleep(0.1)
        twice = unirl(args, env, check=False)
        refused = next((ln for ln in twice.stderr.splitlines() if "is being run by" in ln), "")
        server.stop()
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(10)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the run did not survive the S3 outage:\n{err[-3000:]}")
        audited = bench.audit(f"{root}/r", {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": url}})
        local = bench.work / "s3-copy"
        fs.get(f"{bucket}/runs/r", str(local / "r"), recursive=True)
        same, _ = bench.equal(local / "r", key="-nosft", extra=NO_SFT)
        same = same and not audited
        retries = "retried with backoff" if "unreachable" in err else "no call met the outage"
        return Row("S3 (moto) down for 10 s mid-run; the same run started twice on S3",
                   f"{retries}, run completes; second start: {refused[7:160] if refused else 'NOT refused'}",
                   same and bool(refused))
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()


def disk_full_row(bench: Bench) -> Row:
    """The run folder on a 2 MB tmpfs: the write that does not fit fails naming the file, nothing
    partial is committed; on a larger tmpfs the same command resumes."""
    mount = bench.work / "tmpfs"
    mount.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        return Row("disk full while writing", "skipped: this machine cannot mount a tmpfs (needs root)", None)
    try:
        failed = unirl(run_args(mount, "r", NO_SFT), bench.env, check=False)
        said = next((ln for ln in failed.stderr.splitlines() if "no space left" in ln.lower()), failed.stderr[-300:])
        partial = [p for p in mount.rglob("*.tmp")]
        committed_ok = all((mount / "r" / f).exists() for m in mount.rglob("manifests/*.json")
                           for f in json.loads(m.read_text()).get("files", []))
        subprocess.run(["mount", "-o", "remount,size=512m", str(mount)], check=True)
        unirl(run_args(mount, "r", NO_SFT), bench.env)
        same, _ = bench.equal(mount / "r", key="-nosft", extra=NO_SFT)
        ok = failed.returncode == 1 and "no space left" in said.lower() and not partial and committed_ok
        return Row("disk full while writing (2 MB tmpfs)", said.removeprefix("error: ")[:200] + "; after freeing space the run resumes",
                   same and ok)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def reward_server_row(bench: Bench) -> Row:
    """The reward server is down (connection refused) when scoring starts and comes up 4 s later:
    the remote scorer retries with backoff and the run completes with the rewards a local scorer
    gives (the same training as the reference)."""
    port = free_port()
    token = "fault-table-token"
    config = bench.work / "reward.yaml"
    config.write_text(json.dumps({"port": port, "log_level": "warning", "scorers": [{"name": "exact_match"}]}))
    root = bench.work / "reward"
    remote = f"reward.scorers=[{{name: remote, params: {{url: 'http://127.0.0.1:{port}', attempts: 8}}}}]"
    env = {**bench.env, "UNIRL_REWARD_TOKEN": token}
    run = popen([sys.executable, "-m", "unirl.flows.cli", *run_args(root, "r", [*NO_SFT, remote, "eval.scorer=exact_match"])],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        deadline = time.monotonic() + 600
        while not (root / "r" / "iter-000000" / "manifests" / "generate.json").exists():
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended before scoring: {run.communicate()[1][-3000:]}")
            time.sleep(0.1)
        time.sleep(4)
        server = subprocess.Popen([sys.executable, "-m", "unirl.flows.reward_server", "--config", str(config)], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, err = run.communicate(timeout=900)
        if run.returncode != 0:
            raise RuntimeError(f"the run did not survive the reward server's outage:\n{err[-3000:]}")
        ref = bench.reference("-nosft", NO_SFT)
        mine = snapshot(root / "r", bench.env, ITERATIONS)
        same = [x["train"] for x in mine["iterations"]] == [x["train"] for x in ref["iterations"]] and mine["weights"] == ref["weights"]
        same = same and not bench.audit(root / "r")
        return Row("reward server down (connection refused) for 4 s, then up",
                   "the remote scorer retries with backoff; the run completes", same)
    finally:
        for proc in (run, server):
            if proc is not None and proc.poll() is None:
                proc.kill()


def _memory_growth_mb(pid: int, request: Callable[[], Any]) -> tuple[Any, float, float]:
    """`request()`'s answer, the server's resident memory before it and how far its peak (VmHWM)
    rose above that while it ran, in MB (writing 5 to clear_refs resets the peak to the current size)."""
    def status(key: str) -> float:
        text = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith(key))) / 1024

    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = status("VmRSS:")
    answer = request()
    return answer, before, status("VmHWM:") - before


def _wait_healthy(health_url: str, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(health_url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


def reward_limit_rows(bench: Bench) -> list[Row]:
    """What the reward server refuses (status and message) and how far its memory rose, for the
    largest request its default limits accept and for requests past each limit; a normal request
    still scores after each (a row fails when it does not)."""
    import io

    import httpx
    import pyarrow as pa
    from PIL import Image

    from unirl.stages.rewards.base import ScoreBatch
    from unirl.stages.rewards.wire import Limits, encode_batch

    limits, port, token = Limits(), free_port(), "fault-table-token"
    config = bench.work / "limits.yaml"
    config.write_text(json.dumps({"port": port, "log_level": "warning", "scorers": [{"name": "brightness"}]}))
    server = subprocess.Popen([sys.executable, "-m", "unirl.flows.reward_server", "--config", str(config)], cwd=REPO,
                              env={**bench.env, "UNIRL_REWARD_TOKEN": token}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}

    def post(body: bytes) -> httpx.Response:
        return httpx.post(f"{url}/v1/score", content=body, headers=auth, timeout=600)

    def png(side: int, colour: int = 128) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (side, side), (colour,) * 3).save(out, format="PNG")
        return out.getvalue()

    def images(n: int, side: int) -> bytes:
        one = png(side)
        return encode_batch(ScoreBatch([f"g/{i}" for i in range(n)], ["p"] * n, images=[one] * n))

    def stream(table: pa.Table, compression: str | None = None) -> bytes:
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
            writer.write_table(table)
        return sink.getvalue()

    side = int((limits.max_pixels // limits.max_rows) ** 0.5)  # every row an image, together at the pixel limit
    cases = [
        (f"largest accepted: {limits.max_rows} rows, each a {side}x{side} PNG ({limits.max_rows * side * side / 1e6:.0f}M pixels)",
         lambda: images(limits.max_rows, side)),
        (f"{limits.max_rows + 1} rows (`max_rows`)", lambda: images(limits.max_rows + 1, 4)),
        ("nine 4000x4000 PNGs (`max_pixels`)", lambda: images(9, 4000)),
        ("10 KB of zstd Arrow expanding to 300 MB (`max_decoded_bytes`)",
         lambda: stream(pa.table({"sample_id": ["a"], "prompt": ["x" * (300 << 20)]}), "zstd")),
        ("metadata nested 100k deep (`max_metadata_depth`)",
         lambda: stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "metadata": ["[" * 100_000 + "]" * 100_000]}))),
    ]
    rows = []
    try:
        _wait_healthy(f"{url}/healthz", server, "the reward server", 120)
        for what, body in cases:
            data = body()
            answer, before, growth = _memory_growth_mb(server.pid, partial(post, data))
            said = "200" if answer.status_code == 200 else f"{answer.status_code}: {answer.json()['error'][:140]}"
            healthy = post(images(2, 8)).status_code == 200
            rows.append(Row(f"reward server: {what}, {len(data) / 1e6:.1f} MB on the wire",
                            f"{said}; resident memory {before:.0f} MB, peak +{growth:.0f} MB; "
                            f"{'healthy after (a normal request scores)' if healthy else 'NOT healthy after'}",
                            None if healthy else False))
    finally:
        server.kill()
    return rows


def engine_limit_rows(bench: Bench) -> list[Row]:
    """What `unirl engine-server` (the tiny Qwen3 of recipes/ar/tiny.yaml, a 256-token context)
    refuses past each default limit and how far its memory rose, for the largest request its limits
    accept and for requests past them; a normal request still samples after each."""
    import httpx

    from unirl.stages.engines.limits import Limits

    limits, port, token = Limits(), free_port(), "fault-table-token"
    server = subprocess.Popen([sys.executable, "-m", "unirl.flows.cli", "engine-server", str(REPO / "recipes" / "ar" / "tiny.yaml"),
                               "--port", str(port)], cwd=REPO, env={**bench.env, "UNIRL_ENGINE_TOKEN": token},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def generate(prompts: int, tokens: int, new: int = 1) -> bytes:
        ids = [[3 + (i % 7) for i in range(tokens)]] * prompts
        return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 1.0}}).encode()

    def huge() -> Any:  # 26M tokens with no declared length: the body is counted as it is read
        chunk = ("3," * 500_000).encode()
        yield b'{"input_ids": ['
        for _ in range(52):
            yield chunk
        yield b'3], "sampling_params": {"max_new_tokens": 1}}'

    cases = [
        (f"largest accepted: {limits.max_prompts} prompts of 255 tokens (the context), 1 new token each", lambda: generate(limits.max_prompts, 255)),
        (f"{limits.max_prompts + 1} prompts (`--max-prompts`)", lambda: generate(limits.max_prompts + 1, 4)),
        ("one prompt of 26M tokens, streamed without a length (`--max-request-bytes`)", huge),
        ("a prompt past the model's context (256 tokens)", lambda: generate(1, 300)),
        (f"max_new_tokens {limits.max_new_tokens + 1} (`--max-new-tokens`)", lambda: generate(1, 4, limits.max_new_tokens + 1)),
        ("input_ids a string (malformed field)", lambda: b'{"input_ids": "abc"}'),
    ]
    rows = []
    try:
        _wait_healthy(f"{url}/health", server, "the engine server", 180)
        for what, body in cases:
            data = body()
            size = f"{len(data) / 1e6:.1f} MB" if isinstance(data, bytes) else "52 MB"
            answer, before, growth = _memory_growth_mb(
                server.pid, partial(httpx.post, f"{url}/generate", content=data, headers=auth, timeout=600))
            said = "200" if answer.status_code == 200 else f"{answer.status_code}: {str(answer.json().get('message'))[:140]}"
            healthy = httpx.post(f"{url}/generate", content=generate(1, 4, 2), headers=auth, timeout=60).status_code == 200
            rows.append(Row(f"engine server: {what}, {size} on the wire",
                            f"{said}; resident memory {before:.0f} MB, peak +{growth:.0f} MB; "
                            f"{'healthy after (a normal request samples)' if healthy else 'NOT healthy after'}",
                            None if healthy else False))
    finally:
        server.kill()
    return rows


ROWS: dict[str, Callable[[Bench], list[Row]]] = {
    "kill": lambda b: kill_rows(b, chained=False),
    "rank": lambda b: [rank_row(b)],
    "node": lambda b: [node_row(b)],
    "s3": lambda b: [s3_row(b)],
    "disk": lambda b: [disk_full_row(b)],
    "checkpoint": checkpoint_rows,
    "reward": lambda b: [reward_server_row(b)],
    "limits": lambda b: reward_limit_rows(b) + engine_limit_rows(b),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--chained", action="store_true", help="the SIGKILL rows in one run folder (as the tests do)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unirl-faults-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "UNIRL_FAULTS"))}
    env.update(PREFECT_HOME=str(work / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    bench = Bench(work, env)
    rows: list[Row] = []
    for key in args.rows:
        started = time.monotonic()
        made = kill_rows(bench, True) if key == "kill" and args.chained else ROWS[key](bench)
        rows += made
        print(f"[faults] {key}: {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    print("| fault | what the user sees | resumed run equals an uninterrupted one |\n|---|---|---|")
    for row in rows:
        print(row.line())
    return 0 if all(r.equal is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

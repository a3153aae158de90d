"""Reward server under concurrent load, on loopback.

    python benchmarks/reward_server.py [--requests 200] [--samples 16] [--in-flight 200] [--clip]

Starts `python -m unirl.flows.reward_server` with rule scorers (text_length, keyword, constant; with
--clip also a tiny random CLIP scoring 32-px images), sends --requests requests of --samples
samples each, at most --in-flight at a time, and prints throughput and p50/p95 latency. Every
answer is checked against the same scorers run in this process: the run fails (exit 1) unless
all requests come back 200 with the right sample ids and scores.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from unirl.stages.rewards import ScoreBatch
from unirl.stages.rewards.server import ScoringService, load_config
from unirl.stages.rewards.wire import CONTENT_TYPE, encode_batch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/tiny_reward_models.py: tiny random reward models

WORDS = ["cat", "dog", "bird", "sofa", "sunset", "a", "the", "on", "red", "blue"]


def make_batch(i: int, n: int, images: list | None) -> ScoreBatch:
    rng = np.random.default_rng(i)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(0, 12))) for _ in range(n)]
    return ScoreBatch([f"r{i}/{j}" for j in range(n)], [f"prompt {i} {j}" for j in range(n)],
                      texts=texts, images=images)


def start_server(config_path: Path, token: str) -> subprocess.Popen:
    env = {**os.environ, "UNIRL_REWARD_TOKEN": token}
    return subprocess.Popen([sys.executable, "-m", "unirl.flows.reward_server", "--config", str(config_path)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"server not ready after {timeout_s}s")


async def send_all(url: str, token: str, bodies: list[bytes], in_flight: int) -> tuple[list, list[float], float]:
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": CONTENT_TYPE}
    gate = asyncio.Semaphore(in_flight)
    latencies = [0.0] * len(bodies)

    async with httpx.AsyncClient(limits=limits, headers=headers, timeout=300.0) as client:
        async def one(i: int, body: bytes) -> httpx.Response:
            async with gate:
                start = time.perf_counter()
                response = await client.post(f"{url}/v1/score", content=body)
                latencies[i] = time.perf_counter() - start
                return response

        start = time.perf_counter()
        responses = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)), return_exceptions=True)
        wall = time.perf_counter() - start
    return responses, latencies, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=200, help="client-side bound on concurrent requests")
    parser.add_argument("--server-concurrency", type=int, default=2, help="server max_concurrency")
    parser.add_argument("--clip", action="store_true", help="add a tiny random CLIP scorer on 32-px images")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="reward_bench_"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scorers = [
        {"name": "text_length", "weight": 0.01},
        {"name": "keyword", "key": "kw", "weight": 1.0, "params": {"keywords": ["cat", "dog", "sunset"]}},
        {"name": "constant", "weight": 1.0, "params": {"value": 0.5}},
    ]
    images = None
    if args.clip:
        from tests.tiny_reward_models import random_images, save_tiny_clip

        scorers.append({"name": "clip", "params": {"model_path": str(save_tiny_clip(tmp / "clip")), "device": "cpu"}})
        images = random_images(args.samples, size=(32, 32))
    config_path = tmp / "server.yaml"
    config_path.write_text(yaml.safe_dump({
        "port": port, "scorers": scorers, "aggregation": "weighted_sum", "log_level": "warning",
        "max_concurrency": args.server_concurrency, "max_queue": args.requests, "timeout_s": 300,
    }))
    token = secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"

    batches = [make_batch(i, args.samples, images) for i in range(args.requests)]
    bodies = [encode_batch(b) for b in batches]
    local = ScoringService(load_config(config_path))
    expected = [local.score(b).scores for b in batches]

    proc = start_server(config_path, token)
    try:
        wait_ready(url, proc)
        responses, latencies, wall = asyncio.run(send_all(url, token, bodies, args.in_flight))
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    failures = []
    for i, (batch, want, response) in enumerate(zip(batches, expected, responses)):
        if isinstance(response, Exception):
            failures.append(f"request {i}: {type(response).__name__}: {response}")
        elif response.status_code != 200:
            failures.append(f"request {i}: HTTP {response.status_code}: {response.text[:200]}")
        elif response.json()["sample_ids"] != batch.sample_ids:
            failures.append(f"request {i}: wrong sample ids")
        elif not np.allclose(response.json()["total"], want, rtol=0, atol=1e-6 if args.clip else 0):
            failures.append(f"request {i}: scores differ from local scoring")
    lat_ms = np.array(latencies) * 1000
    n_samples = args.requests * args.samples
    print(f"reward server benchmark: {args.requests} requests x {args.samples} samples, "
          f"in flight <= {args.in_flight}, server max_concurrency={args.server_concurrency}, "
          f"scorers={[s.get('key', s['name']) for s in scorers]}")
    print(f"wall {wall:.3f} s | throughput {args.requests / wall:.1f} req/s, {n_samples / wall:.0f} samples/s")
    print(f"latency p50 {np.percentile(lat_ms, 50):.1f} ms | p95 {np.percentile(lat_ms, 95):.1f} ms | "
          f"max {lat_ms.max():.1f} ms")
    print(f"answers correct: {args.requests - len(failures)}/{args.requests}")
    for line in failures[:10]:
        print("  " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The reward server as users run it: real `python -m unirl.flows.reward_server` processes on loopback,
spoken to over HTTP by httpx and by RemoteScorer."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import yaml

from tests.conftest import TINY, run_unirl
from tests.tiny_reward_models import random_images, save_tiny_clip
from unirl.flows.reward_server import main
from unirl.stages.rewards import ScoreBatch, aggregate, build_scorer, run_scorer
from unirl.stages.rewards.client import RemoteScorer, RemoteScorerError
from unirl.stages.rewards.server import ScoringService, load_config
from unirl.stages.rewards.wire import encode_batch
from unirl.stages.runtime.sample import metadata

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOKEN = "e2e-token-9f8e7d6c5b4a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 32_768

RULES = [  # text_length, keyword and constant: values a reader can add up by hand
    {"name": "text_length", "weight": 0.5},
    {"name": "keyword", "key": "kw", "weight": 2.0, "params": {"keywords": ["cat", "dog"]}},
    {"name": "constant", "weight": -1.0, "params": {"value": 3.0}},
]
TEXTS = ["a cat", "dog and cat!", "", "bird"]
# text_length = [5, 12, 0, 4], kw = [0.5, 1, 0, 0], constant = 3
EXPECTED = {
    "weighted_sum": [0.5 * 5 + 2 * 0.5 - 3, 0.5 * 12 + 2 * 1 - 3, -3.0, 0.5 * 4 - 3],
    "mean": [(5 + 0.5 + 3) / 3, (12 + 1 + 3) / 3, 1.0, (4 + 3) / 3],
    "min": [0.5, 1.0, 0.0, 0.0],
    "max": [5.0, 12.0, 3.0, 4.0],
}

# A custom scorer module the faulty server imports (config `imports:`); the first sample's
# metadata picks its behaviour, and every call appends a line to `calls`, so tests count tries.
PLUGIN = '''
import math, time
import numpy as np
from unirl.stages.rewards.base import ScoreResult, register_scorer

@register_scorer("faulty", reads=("text",))
class Faulty:
    name = "faulty"
    def __init__(self, calls):
        self.calls = calls
    def __call__(self, batch):
        with open(self.calls, "a") as f:
            f.write("call\\n")
        meta = batch.metadata[0]
        if meta.get("mode") == "fail":
            raise RuntimeError("boom")
        if meta.get("mode") == "sleep":
            time.sleep(meta["seconds"])
        value = math.nan if meta.get("mode") == "nan" else 1.0
        return ScoreResult(np.full(len(batch), value))
'''


@dataclass
class Server:
    url: str
    config: Path
    log: Path
    proc: subprocess.Popen
    relaunch: Callable[[], Server]  # the same server on a new port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, config: dict, root: Path, env: dict[str, str], via_cli: bool = False) -> Server:
    """Start a server process; `via_cli` goes through `unirl reward-server` (unirl.flows.cli)."""
    port = free_port()
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"port": port, "log_level": "warning", **config}))
    log = root / f"{name}.log"
    command = ["unirl.flows.cli", "reward-server"] if via_cli else ["unirl.flows.reward_server"]
    with log.open("w") as out:  # the child keeps its own copy of the file descriptor
        proc = subprocess.Popen([sys.executable, "-m", *command, "--config", str(path)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", path, log, proc, lambda: launch(name, config, root, env, via_cli))


def wait_ready(server: Server, timeout_s: float = 90.0) -> None:
    """Wait for /healthz; a server that lost its free port to another process of the suite before
    it bound it is started again on a new one (`server` takes the new process and url)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            if "address already in use" in server.log.read_text():
                server.__dict__.update(server.relaunch().__dict__)
                continue
            pytest.fail(f"server {server.config.name} exited: {server.log.read_text()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server {server.config.name} not ready after {timeout_s}s: {server.log.read_text()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("reward_server")
    (root / "plugins").mkdir()
    (root / "plugins" / "e2e_faulty_scorers.py").write_text(PLUGIN)
    clip_dir = save_tiny_clip(root / "clip")
    env = {**os.environ, "UNIRL_REWARD_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(root / "plugins")])}
    started = {
        mode: launch(mode, {"aggregation": mode, "scorers": RULES, "max_body_bytes": MAX_BODY}, root, env)
        for mode in EXPECTED
    }
    started["model"] = launch("model", {"scorers": [
        {"name": "clip", "weight": 2.0, "params": {"model_path": str(clip_dir), "device": "cpu"}},
        {"name": "text_length", "weight": 0.1},
    ]}, root, env)
    started["rl"] = launch("rl", {"scorers": [
        {"name": "exact_match"}, {"name": "integer_format", "weight": 0.5},
    ]}, root, env)
    started["faulty"] = launch("faulty", {
        "auth": False, "timeout_s": 0.5, "max_concurrency": 2, "max_queue": 1, "imports": ["e2e_faulty_scorers"],
        "scorers": [{"name": "faulty", "params": {"calls": str(root / "calls.txt")}}],
    }, root, env, via_cli=True)
    try:
        for server in started.values():
            wait_ready(server)
        yield started
    finally:
        for server in started.values():
            server.proc.terminate()
        for server in started.values():
            try:
                server.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.proc.kill()


def rule_batch() -> ScoreBatch:
    return ScoreBatch([f"g/{i}" for i in range(len(TEXTS))], ["p"] * len(TEXTS), texts=TEXTS)


def post(server: Server, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/score", content=body, headers=headers or {}, timeout=30)


def test_healthz(servers):
    for name, server in servers.items():
        answer = httpx.get(f"{server.url}/healthz").json()
        assert answer["status"] == "ok"
        assert answer["aggregation"] == (name if name in EXPECTED else "weighted_sum")
    assert httpx.get(f"{servers['mean'].url}/healthz").json()["scorers"] == ["text_length", "kw", "constant"]


@pytest.mark.parametrize("headers, message", [
    ({}, "missing bearer token"),
    ({"Authorization": "Bearer wrong-token"}, "invalid bearer token"),
    ({"Authorization": f"Basic {TOKEN}"}, "invalid bearer token"),
])
def test_missing_or_wrong_token_is_401(servers, headers, message):
    response = post(servers["weighted_sum"], encode_batch(rule_batch()), headers)
    assert response.status_code == 401
    assert message in response.json()["error"]
    assert response.headers["www-authenticate"] == "Bearer"


def test_oversized_body_is_413_and_not_retried(servers):
    response = post(servers["weighted_sum"], b"\0" * (MAX_BODY + 1), AUTH)
    assert response.status_code == 413
    assert f"exceeds max_body_bytes={MAX_BODY}" in response.json()["error"]
    big = ScoreBatch(["a"], ["p"], texts=["x" * (MAX_BODY + 10)])
    with pytest.raises(RemoteScorerError, match="refused the request: HTTP 413"):
        RemoteScorer(servers["weighted_sum"].url, token=TOKEN, attempts=3)(big)


@pytest.mark.parametrize("body, message", [
    (b"definitely not arrow", "not a readable Arrow IPC stream"),
    (encode_batch(ScoreBatch(["a"], ["p"]))[:-20], "not a readable Arrow IPC stream"),
    ("table", "missing required column 'prompt'"),
    ("png", "image of sample 'a' is not a decodable image"),
])
def test_malformed_arrow_is_400_naming_the_problem(servers, body, message):
    if body == "table":
        body = _stream(pa.table({"sample_id": ["a"], "text": ["t"]}))
    elif body == "png":
        body = _stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "image": [b"\x89PNG broken"]}))
    server = servers["model"] if message.startswith("image") else servers["weighted_sum"]  # images are decoded where a scorer reads them
    response = post(server, body, AUTH)
    assert response.status_code == 400
    assert message in response.json()["error"]


def _stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregation_equals_hand_computed(servers, mode):
    response = post(servers[mode], encode_batch(rule_batch()), AUTH)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["sample_ids"] == ["g/0", "g/1", "g/2", "g/3"] and answer["aggregation"] == mode
    np.testing.assert_allclose(answer["total"], EXPECTED[mode], rtol=0, atol=1e-12)
    assert answer["components"] == {"text_length": [5.0, 12.0, 0.0, 4.0], "kw": [0.5, 1.0, 0.0, 0.0],
                                    "kw/hits": [1.0, 2.0, 0.0, 0.0], "constant": [3.0] * 4}


def test_remote_equals_local_and_mixes_with_local_scorers(servers):
    server = servers["weighted_sum"]
    texts = ["a cat", "dog", "", "catdog", "x" * 40, "Dog and CAT", "bird"]
    batch = ScoreBatch([f"m/{i}" for i in range(7)], [f"q{i}" for i in range(7)], texts=texts)
    local = ScoringService(load_config(server.config)).score(batch)
    remote = RemoteScorer(server.url, token=TOKEN, batch_size=3)
    served = run_scorer(remote, batch)
    np.testing.assert_array_equal(served.scores, local.scores)
    assert served.components.keys() == local.components.keys()
    for key in local.components:
        np.testing.assert_array_equal(served.components[key], local.components[key])
    mixed = aggregate({"remote": served, "words": run_scorer(build_scorer("text_length", unit="words"), batch)},
                      {"remote": 1.0, "words": 10.0})
    np.testing.assert_array_equal(mixed.scores, local.scores + 10.0 * np.array([2, 1, 0, 1, 1, 3, 1]))
    assert "remote/kw/hits" in mixed.components


def test_model_scorer_remote_equals_local(servers):
    server = servers["model"]
    images = random_images(5, seed=11)
    batch = ScoreBatch([f"i/{i}" for i in range(5)], ["a cat", "hello", "xyz", "sunset", "a dog"],
                       texts=["t", "tt", "ttt", "", "x"], images=images)
    local = ScoringService(load_config(server.config)).score(batch)
    served = RemoteScorer(server.url, token=TOKEN)(batch)
    np.testing.assert_allclose(served.scores, local.scores, rtol=0, atol=1e-6)
    np.testing.assert_allclose(served.components["clip"], local.components["clip"], rtol=0, atol=1e-6)


def faulty_batch(**meta) -> ScoreBatch:
    return ScoreBatch(["f/0", "f/1"], ["p", "q"], metadata=[meta, {}])


def test_auth_off_needs_no_token(servers):
    response = post(servers["faulty"], encode_batch(faulty_batch(mode="ok")))
    assert response.status_code == 200 and response.json()["total"] == [1.0, 1.0]


def test_failing_scorer_is_named_and_surfaced_after_retries(servers, caplog):
    calls = servers["faulty"].config.parent / "calls.txt"
    calls.write_text("")
    response = post(servers["faulty"], encode_batch(faulty_batch(mode="fail")))
    assert response.status_code == 500
    assert response.json() == {"error": "scorer 'faulty' failed: RuntimeError: boom", "scorer": "faulty"}
    calls.write_text("")
    remote = RemoteScorer(servers["faulty"].url, attempts=3, backoff_s=0.05)
    with caplog.at_level(logging.WARNING, logger="unirl.stages.rewards.client"):
        with pytest.raises(RemoteScorerError,
                           match=r"failed after 3 attempt\(s\).*HTTP 500: scorer 'faulty' failed: RuntimeError: boom"):
            remote(faulty_batch(mode="fail"))
    assert calls.read_text().count("call") == 3
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 2


def test_non_finite_score_is_an_error_naming_scorer_and_sample(servers):
    response = post(servers["faulty"], encode_batch(faulty_batch(mode="nan")))
    assert response.status_code == 500
    assert response.json()["error"] == "scorer 'faulty' returned nan for sample 'f/0'"


def test_timeout_is_504(servers):
    start = time.monotonic()
    response = post(servers["faulty"], encode_batch(faulty_batch(mode="sleep", seconds=2.0)))
    assert response.status_code == 504
    assert "timeout_s=0.5" in response.json()["error"]
    assert time.monotonic() - start < 1.8


def wait_idle(server: Server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{server.url}/healthz").json()["in_flight"]:
        assert time.monotonic() < deadline, "the server never got its worker slots back"
        time.sleep(0.1)


def test_concurrency_is_bounded_and_slots_come_back(servers):
    """max_concurrency 2 + max_queue 1: of 4 simultaneous slow requests, one is turned away."""
    server = servers["faulty"]
    wait_idle(server)
    body = encode_batch(faulty_batch(mode="sleep", seconds=1.0))
    with ThreadPoolExecutor(4) as pool:
        codes = sorted(r.status_code for r in pool.map(lambda _: post(server, body), range(4)))
    assert codes == [503, 504, 504, 504]
    wait_idle(server)  # timed-out work held its slot until it finished, then gave it back
    assert post(server, encode_batch(faulty_batch(mode="ok"))).status_code == 200


def test_token_is_never_logged(servers, caplog):
    with caplog.at_level(logging.DEBUG):
        RemoteScorer(servers["weighted_sum"].url, token=TOKEN)(rule_batch())
        with pytest.raises(RemoteScorerError, match="HTTP 401"):
            RemoteScorer(servers["weighted_sum"].url, token=TOKEN + "-wrong")(rule_batch())
    assert caplog.records and TOKEN not in caplog.text
    for server in servers.values():
        assert TOKEN not in server.log.read_text()


def test_token_from_a_prefect_secret_block(servers, monkeypatch):
    from prefect.blocks.system import Secret

    from unirl.tasks.reward_token import reward_token_from_secret

    class FakeSecret:
        def get(self) -> str:
            return TOKEN

    monkeypatch.setattr(Secret, "load", classmethod(lambda cls, name: FakeSecret()))
    scorer = RemoteScorer(servers["max"].url, token=reward_token_from_secret("reward-server-token"))
    np.testing.assert_array_equal(scorer(rule_batch()).scores, EXPECTED["max"])


def test_cli_rejects_bad_configs_before_serving(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scorers: [{name: constant}]\naggregation: median\n")
    assert main(["--config", str(bad)]) == 2
    assert "aggregation: Input should be" in capsys.readouterr().err
    monkeypatch.delenv("UNIRL_REWARD_TOKEN", raising=False)
    no_token = tmp_path / "no_token.yaml"
    no_token.write_text("scorers: [{name: constant}]\n")
    assert main(["--config", str(no_token)]) == 2
    assert "$UNIRL_REWARD_TOKEN is empty" in capsys.readouterr().err


def test_rl_recipe_with_remote_reward_gives_the_local_rewards(servers, tmp_path, unirl_env):
    """The AR smoke recipe, one iteration, its reward served by the `rl` server; rewards.arrow
    must equal the same scorers run locally on the rollouts it wrote."""
    server = servers["rl"]
    root = tmp_path / "runs"
    env = {**unirl_env, "UNIRL_REWARD_TOKEN": TOKEN}
    remote = f"reward.scorers=[{{name: remote, params: {{url: '{server.url}', batch_size: 8}}}}]"
    run_unirl(["run", str(TINY), "iterations=1", f"storage.root={root}", remote], env)
    it = root / "tiny" / "iter-000000"
    rollouts = pa.concat_tables(
        [ipc.open_file(str(p)).read_all() for p in sorted((it / "rollouts").iterdir())]
    ).sort_by("sample_id")
    batch = ScoreBatch(rollouts.column("sample_id").to_pylist(), rollouts.column("prompt").to_pylist(),
                       texts=rollouts.column("text").to_pylist(), metadata=metadata(rollouts),
                       finish_reasons=rollouts.column("finish_reason").to_pylist())
    local = ScoringService(load_config(server.config)).score(batch)
    rewards = ipc.open_file(str(it / "rewards.arrow")).read_all().sort_by("sample_id")
    assert rewards.column("sample_id").to_pylist() == batch.sample_ids
    np.testing.assert_array_equal(rewards.column("reward").to_numpy(), local.scores)
    for name in ("exact_match", "integer_format"):
        np.testing.assert_array_equal(rewards.column(f"reward/remote/{name}").to_numpy(), local.components[name])


def test_a_token_put_in_the_url_by_mistake_is_not_in_the_access_log(tmp_path):
    """Regression: uvicorn's access log recorded `?token=...` verbatim."""
    env = {**os.environ, "UNIRL_REWARD_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    server = launch("access", {"scorers": RULES, "log_level": "info"}, tmp_path, env)
    try:
        wait_ready(server)
        assert httpx.get(f"{server.url}/healthz?token={TOKEN}&verbose=1").status_code == 200
        assert httpx.post(f"{server.url}/v1/score?api_key={TOKEN}", content=b"{}").status_code == 401
        time.sleep(0.5)
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)
    log = server.log.read_text()
    assert "GET /healthz?token=***&verbose=1" in log and "POST /v1/score?api_key=***" in log, log[-2000:]
    assert TOKEN not in log

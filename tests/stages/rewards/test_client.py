"""RemoteScorer against an in-process fake server (httpx.MockTransport): batching, retries,
backoff, no retry on 4xx, and the token never showing up in logs, reprs or errors."""
import logging

import httpx
import numpy as np
import pytest

from unirl.stages.rewards import ScoreBatch, build_scorer
from unirl.stages.rewards import client as client_module
from unirl.stages.rewards.client import RemoteScorer, RemoteScorerError
from unirl.stages.rewards.wire import decode_batch

TOKEN = "s3cr3t-token-value"


class FakeServer:
    """Scores total = len(prompt); answers with `failures` (status or exception) first."""

    def __init__(self, failures=()):
        self.failures = list(failures)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.failures:
            failure = self.failures.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return httpx.Response(failure, json={"error": f"scorer 'boom' failed: RuntimeError: {failure}",
                                                 "scorer": "boom"})
        batch = decode_batch(request.content)
        lengths = [float(len(p)) for p in batch.prompts]
        return httpx.Response(200, json={"sample_ids": batch.sample_ids, "total": lengths,
                                         "components": {"len": lengths}, "aggregation": "weighted_sum"})


def remote(server: FakeServer, **kwargs) -> RemoteScorer:
    kwargs.setdefault("backoff_s", 0.0)
    return RemoteScorer("http://reward.test", transport=httpx.MockTransport(server), **kwargs)


def batch(n: int) -> ScoreBatch:
    return ScoreBatch([f"g/{i}" for i in range(n)], ["x" * i for i in range(n)], texts=["t"] * n)


def test_batches_are_split_and_reassembled_in_order():
    server = FakeServer()
    result = remote(server, token=TOKEN, batch_size=4)(batch(10))
    assert [len(decode_batch(r.content)) for r in server.requests] == [4, 4, 2]
    np.testing.assert_array_equal(result.scores, np.arange(10.0))
    np.testing.assert_array_equal(result.components["len"], np.arange(10.0))
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in server.requests)
    assert server.requests[0].headers["content-type"] == "application/vnd.apache.arrow.stream"


@pytest.mark.parametrize("failure", [500, 503, 504, httpx.ReadTimeout("slow"), httpx.ConnectError("refused"),
                                     httpx.RemoteProtocolError("server disconnected")])
def test_retries_transient_failures_then_succeeds(failure):
    server = FakeServer([failure, failure])
    result = remote(server, attempts=3)(batch(3))
    assert len(server.requests) == 3
    np.testing.assert_array_equal(result.scores, [0.0, 1.0, 2.0])


def test_error_after_last_try_names_the_servers_message(caplog):
    server = FakeServer([500] * 5)
    with caplog.at_level(logging.WARNING, logger="unirl.stages.rewards.client"):
        with pytest.raises(RemoteScorerError, match=r"failed after 3 attempt\(s\).*HTTP 500: scorer 'boom' failed"):
            remote(server, attempts=3)(batch(2))
    assert len(server.requests) == 3
    assert [r.getMessage().split(": attempt ")[1][:3] for r in caplog.records] == ["1/3", "2/3"]


@pytest.mark.parametrize("status", [400, 401, 413, 422])
def test_client_errors_are_not_retried(status):
    server = FakeServer([status] * 3)
    with pytest.raises(RemoteScorerError, match=f"refused the request: HTTP {status}: scorer 'boom'"):
        remote(server, attempts=3)(batch(2))
    assert len(server.requests) == 1


def test_non_transient_transport_errors_are_not_retried():
    server = FakeServer([httpx.UnsupportedProtocol("bad scheme")] * 3)
    with pytest.raises(RemoteScorerError, match="UnsupportedProtocol: bad scheme"):
        remote(server, attempts=3)(batch(1))
    assert len(server.requests) == 1


def test_backoff_doubles_up_to_the_cap(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    with pytest.raises(RemoteScorerError):
        remote(FakeServer([502] * 9), attempts=5, backoff_s=0.5, max_backoff_s=1.5)(batch(1))
    assert waits == [0.5, 1.0, 1.5, 1.5]


def test_token_from_env_and_never_shown(monkeypatch, caplog):
    monkeypatch.setenv("MY_REWARD_TOKEN", TOKEN)
    server = FakeServer([503, 401])
    scorer = remote(server, token_env="MY_REWARD_TOKEN", attempts=3)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(RemoteScorerError) as err:
            scorer(batch(2))
    assert server.requests[0].headers["authorization"] == f"Bearer {TOKEN}"
    assert "$MY_REWARD_TOKEN" in str(err.value)  # the 401 says where the token comes from
    shown = caplog.text + str(err.value) + repr(scorer) + repr(err.value.__cause__)
    assert caplog.records and TOKEN not in shown


def test_no_token_sends_no_header(monkeypatch):
    monkeypatch.delenv("UNIRL_REWARD_TOKEN", raising=False)
    server = FakeServer()
    remote(server)(batch(1))
    assert "authorization" not in server.requests[0].headers


def test_buildable_by_name_for_recipes():
    scorer = build_scorer("remote", url="http://reward.test", token=TOKEN,
                          transport=httpx.MockTransport(FakeServer()))
    assert isinstance(scorer, RemoteScorer) and scorer.name == "remote"
    np.testing.assert_array_equal(scorer(batch(2)).scores, [0.0, 1.0])

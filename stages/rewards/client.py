"""`RemoteScorer`: a Scorer that asks a reward server (stages/rewards/server.py) for the scores.

It conforms to the `Scorer` protocol, so a recipe can mix it with local scorers (build it by name
as `remote`). Batches are split into requests of at most `batch_size` samples. A request that
times out, cannot connect, or gets a 5xx is retried with exponential backoff
(backoff_s * 2**k, capped at max_backoff_s); a 4xx is not retried (it would fail the same way).
After the last attempt the error names the server's own message.

The token is the caller's: passed in, or read from the env var `token_env`
(tasks/reward_token.py reads it from a Prefect Secret block). It is never logged or shown.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import httpx
import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScorerError, ScoreResult
from unirl.stages.rewards.wire import CONTENT_TYPE, WireError, encode_batch, result_from_json

log = logging.getLogger(__name__)


class RemoteScorerError(ScorerError):
    """The reward server could not score a batch; the message carries the server's answer."""


class _Retryable(Exception):
    """One failed attempt that is worth retrying (timeout, connection error, 5xx)."""


def _server_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body.get("error") or body.get("detail") or body
    except ValueError:
        message = response.text[:500]
    return f"HTTP {response.status_code}: {message}"


def _take(batch: ScoreBatch, sl: slice) -> ScoreBatch:
    def cut(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else values[sl]

    return ScoreBatch(
        sample_ids=batch.sample_ids[sl],
        prompts=batch.prompts[sl],
        texts=cut(batch.texts),
        images=cut(batch.images),
        videos=cut(batch.videos),
        metadata=batch.metadata[sl],
        finish_reasons=cut(batch.finish_reasons),
        transcripts=cut(batch.transcripts),
    )


class RemoteScorer:
    """Scores through `POST {url}/v1/score`.

    Returns the server's aggregated total as the score and its components unchanged
    (`<scorer>` and `<scorer>/<component>`), so local and remote runs log the same keys.

    Args:
        url: the server's base URL, e.g. http://127.0.0.1:8765.
        token: bearer token; when None it is read from the env var `token_env` (if set).
        batch_size: most samples per request.
        timeout_s: per-request time limit on the client side.
        attempts: tries per request in total (1 = no retries).
        backoff_s, max_backoff_s: wait backoff_s * 2**k before retry k+1, at most max_backoff_s.
        transport: an httpx transport (tests); default is a plain TCP connection pool.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_env: str | None = "UNIRL_REWARD_TOKEN",
        name: str = "remote",
        batch_size: int = 64,
        timeout_s: float = 300.0,
        attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if batch_size < 1 or attempts < 1:
            raise ValueError("RemoteScorer: batch_size and attempts must be >= 1")
        self.name = name
        self.url = url.rstrip("/")
        self.batch_size, self.attempts = batch_size, attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        if token is None and token_env:
            token = os.environ.get(token_env) or None
        self._token_env = token_env
        headers = {"Content-Type": CONTENT_TYPE}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)

    def __repr__(self) -> str:  # never shows the token
        return f"RemoteScorer(name={self.name!r}, url={self.url!r}, batch_size={self.batch_size})"

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        parts = [
            self._score_chunk(_take(batch, slice(i, i + self.batch_size)))
            for i in range(0, len(batch), self.batch_size)
        ]
        keys = list(parts[0].components) if parts else []
        return ScoreResult(
            np.concatenate([p.scores for p in parts]) if parts else np.zeros(0),
            {k: np.concatenate([p.components[k] for p in parts]) for k in keys},
        )

    def health(self) -> dict[str, Any]:
        """GET /healthz (no retries): the server's scorers and aggregation mode."""
        response = self._client.get(f"{self.url}/healthz")
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()

    def _score_chunk(self, chunk: ScoreBatch) -> ScoreResult:
        body = encode_batch(chunk)
        endpoint = f"{self.url}/v1/score"
        for attempt in range(1, self.attempts + 1):
            try:
                return self._post(endpoint, body, chunk.sample_ids)
            except _Retryable as exc:
                if attempt == self.attempts:
                    raise RemoteScorerError(
                        f"reward server {endpoint} failed after {self.attempts} attempt(s) "
                        f"({len(chunk)} samples from {chunk.sample_ids[0]!r}): {exc}"
                    ) from None
                wait = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                log.warning("reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                            endpoint, attempt, self.attempts, exc, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _post(self, endpoint: str, body: bytes, sample_ids: list[str]) -> ScoreResult:
        try:
            response = self._client.post(endpoint, content=body)
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out: {type(exc).__name__}") from exc
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Retryable(f"connection error: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:  # a bad URL or the like: retrying cannot help
            raise RemoteScorerError(f"reward server {endpoint}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _Retryable(_server_message(response))
        if response.status_code >= 400:
            hint = ""
            if response.status_code == 401:
                hint = f" (pass token=, or set ${self._token_env})" if self._token_env else " (pass token=)"
            raise RemoteScorerError(f"reward server {endpoint} refused the request: "
                                    f"{_server_message(response)}{hint}")
        try:
            return result_from_json(response.json(), sample_ids)
        except (ValueError, WireError) as exc:
            raise RemoteScorerError(f"reward server {endpoint} sent an invalid answer: {exc}") from exc

"""Registers `remote`: a scorer served by a reward server, so recipes can mix local and remote
scorers by name (`{name: remote, params: {url: ..., token_env: ...}}`). See client.RemoteScorer."""
from __future__ import annotations

from typing import Any

from unirl.stages.rewards.base import Scorer, register_scorer


@register_scorer("remote", reads=None, schema="unirl.stages.rewards.client:RemoteScorer")
def build_remote(**params: Any) -> Scorer:
    """Keyword args of `RemoteScorer` (url, token, token_env, batch_size, attempts, ...)."""
    # start-up time: loaded on first use
    from unirl.stages.rewards.client import RemoteScorer  # httpx only when a remote scorer is used

    return RemoteScorer(**params)

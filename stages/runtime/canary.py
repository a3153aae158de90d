"""Verified weight sync: after an engine loads a version, its log-probs of a fixed canary token
sequence are compared with the trainer's for that version, which the trainer records in the
version's manifest when it publishes it (`canary: {"tokens", "logprobs"}`). A difference beyond
the engine's tolerance stops the run before a single sample of the wrong weights is trained on:
a reload that was skipped or failed silently, a LoRA adapter the engine did not apply, weights of
another run.

The canary is a seeded draw of ordinary (non-special) token ids, the same for every version of a
run: log p(token_i | tokens_<i) at temperature 1 depends on every weight the tokens pass through.
"""
from __future__ import annotations

import math
import random
from typing import Any

CANARY_TOKENS = 32
CANARY_SEED = 20261205


class CanaryError(RuntimeError):
    """The engine's canary log-probs differ from the trainer's for the version it loaded."""


def canary_tokens(vocab_size: int, special: set[int], context: int | None) -> list[int]:
    """The run's canary: CANARY_TOKENS ordinary token ids (fewer where the context is shorter)."""
    ordinary = [t for t in range(vocab_size) if t not in special]
    n = min(CANARY_TOKENS, (context or CANARY_TOKENS) - 1, len(ordinary) * 4)
    rng = random.Random(CANARY_SEED)
    return [rng.choice(ordinary) for _ in range(max(2, n))]


def canary_diff(engine: list[float], trainer: list[float]) -> float:
    """Largest |engine - trainer| over the canary's log-probs (inf when their lengths differ or a value is not finite)."""
    if len(engine) != len(trainer) or not engine:
        return math.inf
    diff = max(abs(a - b) for a, b in zip(engine, trainer))
    return diff if math.isfinite(diff) else math.inf


def verify(client: Any, canary: dict[str, Any] | None, tolerance: float, *, version: int, what: str,
           lora: str | None = None, asked: tuple[list[int], list[float]] | None = None) -> float | None:
    """Compare the engine's canary log-probs (`client.prompt_logprobs`) with the trainer's
    recorded ones; the largest difference, or None when the version records no canary. Raises
    CanaryError naming the version when it is beyond `tolerance`. `asked`: the engine's answer
    for these tokens already, (tokens, log-probs) (asked again when its tokens are not the canary's)."""
    if not canary or math.isinf(tolerance):
        return None
    tokens = list(canary["tokens"])
    got = asked[1] if asked is not None and list(asked[0]) == tokens else client.prompt_logprobs(tokens, lora)
    diff = canary_diff(got, list(canary["logprobs"]))
    if diff > tolerance:
        raise CanaryError(
            f"{client.name} at {client.url} after {what}: its log-probs of the canary differ from the trainer's for version "
            f"{version} by {diff:.3g} (tolerance {tolerance:g}, rollout.engine.sync.canary_tolerance): the engine does not "
            f"serve the weights of version {version} (a reload or adapter load that did not take). Nothing sampled with "
            "it was trained on; rerun to resume once the engine loads weights")
    return diff

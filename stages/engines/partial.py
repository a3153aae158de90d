"""Partial rollouts (`rollout.partial`, async text RL on a dedicated engine): a generation longer
than `segment_tokens` new tokens is cut there, and the rest of it is sampled in the next batch by
the newer weights the engine has loaded by then, from its prefix (prompt + the tokens so far).
The longest answer of a batch no longer holds the batch back: the batch is the groups that
finished, the unfinished ones ride on. Every response token records the policy version that
sampled it (`token_versions`); a row's `policy_version` is its oldest token's, so the staleness
bound, the off-policy correction (which weighs each token by its own behaviour log-prob) and
`unirl audit` read what the oldest token says.

The schedule, a function of the iteration alone (a resumed run repeats what a killed one did):

* the producer samples batch j with version `producer_version(j)` (stages/run/async_rollout.py):
  one update ahead of the trainer (max_staleness 1's lead), whatever max_staleness is;
* a sample whose oldest token would still be within max_staleness of the iteration after this one
  is cut at `segment_tokens` new tokens this batch; one that would not is sampled to its end
  (so a row is never dropped for staleness: its oldest token is at most max_staleness versions
  older than the iteration that trains it);
* batch j: the carried groups of batch j-1 (their samples continue) and iteration j's new prompt
  groups; rounds of the engine until at least one group has finished (one round unless every
  group was cut); finished groups are the batch (`rollouts/part-000.arrow`), the others its carry
  (`rollouts/carry.arrow`), both committed with the batch's `produce` manifest. A batch thus
  holds a varying number of groups, and the carry of the last batch is never trained.

Cutting at a token count rather than when the trainer publishes keeps the run deterministic: the
same tokens are cut, continued and trained run after run, and after a kill.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unirl.stages.runtime.accumulation import version_of

CARRY = "carry.arrow"


def may_cut(recipe: Any, iteration: int, oldest: int) -> bool:
    """Whether a sample of batch `iteration` whose oldest token is of version `oldest` may be cut
    and finished in the next batch: trained there, it is still within max_staleness."""
    return oldest >= version_of(recipe, iteration + 1) - recipe.rollout.max_staleness


@dataclass
class Partial:
    """One sample in flight: what was sampled of it so far, token by token, and by which version."""

    sample_id: str
    group_id: str
    prompt: str
    metadata: Any
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", or "length" once the whole max_new_tokens is sampled

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> Partial:
        """A carried row (carry.arrow), its `finish_reason` None while it runs on."""
        return cls(row["sample_id"], row["group_id"], row["prompt"], row["metadata"], list(row["prompt_ids"]),
                   list(row["response_ids"]), [float(x) for x in row["response_logprobs"]],
                   [int(v) for v in row["token_versions"]], row["finish_reason"] if row["finish_reason"] else None)

    def done(self) -> bool:
        return self.finish_reason is not None

    def budget(self, max_new_tokens: int, segment_tokens: int, cut: bool) -> int:
        """New tokens it may be given this round: the rest of max_new_tokens, at most a segment when cut."""
        rest = max_new_tokens - len(self.response_ids)
        return min(rest, segment_tokens) if cut else rest

    def extend(self, row: dict[str, Any], max_new_tokens: int, where: str) -> None:
        """Append a round's answer (`row`: response_ids, response_logprobs, finish_reason,
        policy_version, of the continuation of this sample's prefix)."""
        tokens = [int(t) for t in row["response_ids"]]
        if len(self.response_ids) + len(tokens) > max_new_tokens:
            raise ValueError(f"{where}: sample {self.sample_id!r} got {len(tokens)} tokens after {len(self.response_ids)}, "
                             f"past rollout.max_new_tokens {max_new_tokens}: the engine ignored the round's length cap")
        self.response_ids += tokens
        self.response_logprobs += [float(x) for x in row["response_logprobs"]]
        self.token_versions += [int(row["policy_version"])] * len(tokens)
        if row["finish_reason"] == "stop" or len(self.response_ids) >= max_new_tokens:
            self.finish_reason = row["finish_reason"]

    def row(self, decode: Any, eos: int) -> dict[str, Any]:
        """The rollout row (batch or carry): `policy_version` its oldest token's version."""
        body = self.response_ids[:-1] if self.finish_reason == "stop" and self.response_ids[-1:] == [eos] else self.response_ids
        return {"sample_id": self.sample_id, "group_id": self.group_id, "metadata": self.metadata, "prompt": self.prompt,
                "prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "response_logprobs": self.response_logprobs, "token_versions": self.token_versions,
                "finish_reason": self.finish_reason or "", "text": decode(body),
                "policy_version": min(self.token_versions, default=0)}


def finished_groups(pool: list[Partial]) -> tuple[list[Partial], list[Partial]]:
    """(the samples of groups whose every sample is done, the rest), each in pool order."""
    open_groups = {p.group_id for p in pool if not p.done()}
    return [p for p in pool if p.group_id not in open_groups], [p for p in pool if p.group_id in open_groups]

"""Held-out evaluation: greedy accuracy and avg@k / pass@k over one of the data source's fixed
held-out splits: `dev` (what recipes are tuned on; reported during a run as `eval/*`) or `test`
(evaluated before and after RL, reported once after RL as `test/*`). Correctness is the
`eval.scorer` (1 = correct)."""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.recipe import Recipe
from unirl.stages.rewards.base import build_scorer, run_scorer
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.iteration import SCORED_COLUMNS, reads, request_rows, score_batch
from unirl.stages.runtime.sample import read_rollouts, scoring_view, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, join

SPLITS = ("dev", "test")
PREFIX = {"dev": "eval", "test": "test"}  # metric keys: eval/accuracy, test/accuracy


def eval_dir(version: int, split: str = "dev") -> str:
    """eval/vNNNNNN for the dev split, eval/vNNNNNN/test for the test split."""
    if split not in SPLITS:
        raise ValueError(f"unknown evaluation split {split!r} (allowed: {', '.join(SPLITS)})")
    base = join("eval", f"v{version:06d}")
    return base if split == "dev" else join(base, split)


def eval_data(recipe: Recipe) -> Any:
    """The `data` section whose held-out prompts an evaluation draws: a composed recipe's first
    part's (its own, else the recipe's), else the recipe's."""
    if recipe.compose is None:
        return recipe.data
    from unirl.stages.compose import members

    return members(recipe)[0].data or recipe.data


def has_split(recipe: Recipe, split: str) -> bool:
    """Whether the recipe's data source has prompts in `split` (a user's file may have no test split)."""
    return bool(build_prompt_source(eval_data(recipe)).heldout(split))


def write_eval_requests(storage: RunStorage, recipe: Recipe, version: int, group_size: int, name: str,
                        split: str = "dev") -> str:
    prompts = build_prompt_source(recipe.data).heldout(split)
    if not prompts:
        raise ValueError(f"eval: the data source has no {split} prompts (set data.heldout_size > 0"
                         + (", or give the file source a test split)" if split == "test" else ")"))
    rows = request_rows(recipe, prompts, "eval", group_size, version)
    rel = join(eval_dir(version, split), f"{name}-requests.arrow")
    write_shard(storage, rel, table_from_rows(rows, "requests"))
    return rel


def correctness(storage: RunStorage, recipe: Recipe, rollouts: list[str]) -> tuple[list[str], np.ndarray]:
    """(group ids, 0/1 correctness) of every sample in `rollouts`."""
    table = scoring_view(read_rollouts(storage, rollouts, columns=SCORED_COLUMNS))
    name, params = recipe.eval_scorer()
    scores = run_scorer(build_scorer(name, **params), score_batch(
        table, prompt_images=reads([name], "image"), transcripts=reads([name], "transcript"))).scores
    return table.column("group_id").to_pylist(), (scores >= 1.0).astype(np.float64)


def eval_metrics(storage: RunStorage, recipe: Recipe, greedy: list[str], sampled: list[str],
                 split: str = "dev") -> dict[str, float]:
    k, p = recipe.eval.k, PREFIX[split]
    _, greedy_ok = correctness(storage, recipe, greedy)
    groups, ok = correctness(storage, recipe, sampled)
    per_prompt: dict[str, list[float]] = {}
    for g, c in zip(groups, ok):
        per_prompt.setdefault(g, []).append(c)
    return {
        f"{p}/accuracy": float(greedy_ok.mean()),
        f"{p}/avg_at_{k}": float(ok.mean()),
        f"{p}/pass_at_{k}": float(np.mean([max(v) for v in per_prompt.values()])),
        f"{p}/prompts": float(len(greedy_ok)),
        **agent_eval_metrics(storage, sampled, p),
    }


def agent_eval_metrics(storage: RunStorage, sampled: list[str], prefix: str) -> dict[str, float]:
    """An agent's tool use on the held-out prompts' sampled trajectories: assistant turns per
    trajectory (`<prefix>/turns_mean`) and the share of tool calls that gave a result
    (`<prefix>/tool_success`); nothing for rows that are not trajectories."""
    table = read_rollouts(storage, sampled, columns=["agent_turns", "agent_tool_calls", "agent_tool_errors"])
    if "agent_turns" not in table.schema.names:
        return {}
    from unirl.stages.tools.engine import tool_use

    turns, calls, errors = (sum(table.column(c).to_pylist()) for c in ("agent_turns", "agent_tool_calls", "agent_tool_errors"))
    return tool_use(prefix, table.num_rows, turns, calls, errors)

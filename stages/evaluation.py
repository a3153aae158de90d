"""Held-out evaluation: greedy accuracy and avg@k / pass@k over the data source's fixed held-out
split. Correctness is the `eval.scorer` (1 = correct)."""
from __future__ import annotations

import numpy as np

from stages.data import build_prompt_source
from stages.iteration import SCORED_COLUMNS, reads_images, request_rows, score_batch
from stages.recipe import Recipe
from stages.rewards.base import build_scorer, run_scorer
from stages.sample import read_rollouts, scoring_view, table_from_rows, write_shard
from stages.storage import RunStorage, join


def eval_dir(version: int) -> str:
    return join("eval", f"v{version:06d}")


def write_eval_requests(storage: RunStorage, recipe: Recipe, version: int, group_size: int, name: str) -> str:
    prompts = build_prompt_source(recipe.data).heldout()
    if not prompts:
        raise ValueError("eval: the data source has no held-out prompts (set data.heldout_size > 0)")
    rows = request_rows(recipe, prompts, "eval", group_size, version)
    rel = join(eval_dir(version), f"{name}-requests.arrow")
    write_shard(storage, rel, table_from_rows(rows, "requests"))
    return rel


def correctness(storage: RunStorage, recipe: Recipe, rollouts: list[str]) -> tuple[list[str], np.ndarray]:
    """(group ids, 0/1 correctness) of every sample in `rollouts`."""
    table = scoring_view(read_rollouts(storage, rollouts, columns=SCORED_COLUMNS))
    name, params = recipe.eval_scorer()
    scores = run_scorer(build_scorer(name, **params), score_batch(table, prompt_images=reads_images([name]))).scores
    return table.column("group_id").to_pylist(), (scores >= 1.0).astype(np.float64)


def eval_metrics(storage: RunStorage, recipe: Recipe, greedy: list[str], sampled: list[str]) -> dict[str, float]:
    k = recipe.eval.k
    _, greedy_ok = correctness(storage, recipe, greedy)
    groups, ok = correctness(storage, recipe, sampled)
    per_prompt: dict[str, list[float]] = {}
    for g, c in zip(groups, ok):
        per_prompt.setdefault(g, []).append(c)
    return {
        "eval/accuracy": float(greedy_ok.mean()),
        f"eval/avg_at_{k}": float(ok.mean()),
        f"eval/pass_at_{k}": float(np.mean([max(v) for v in per_prompt.values()])),
        "eval/prompts": float(len(greedy_ok)),
    }

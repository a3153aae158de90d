"""Held-out evaluation: greedy accuracy and avg@k / pass@k over one of the data source's fixed
held-out splits: `dev` (what recipes are tuned on; reported during a run as `eval/*`) or `test`
(evaluated before and after RL, reported once after RL as `test/*`). Correctness is the
`eval.scorer` (1 = correct)."""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.compose import members
from unirl.stages.distill import domain_parts
from unirl.stages.engines.agentic import tool_use
from unirl.stages.recipe import Recipe
from unirl.stages.rewards.base import build_scorer, run_scorer
from unirl.stages.run.iteration import SCORED_COLUMNS, reads, request_rows, score_batch
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.sample import metadata, read_rollouts, scoring_view, table_from_rows, write_shard
from unirl.stages.runtime.storage import PREFIX, RunStorage, eval_dir, join


def eval_data(recipe: Recipe) -> Any:
    """The `data` section whose held-out prompts an evaluation draws: a composed recipe's first
    part's (its own, else the recipe's), else the recipe's."""
    if recipe.compose is None:
        return recipe.data

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


def correctness(storage: RunStorage, recipe: Recipe, rollouts: list[str]) -> tuple[list[str], np.ndarray, list[str | None]]:
    """(group ids, 0/1 correctness, domains) of every sample in `rollouts`; a mixture's rows are
    judged by their domain's correctness scorer (`Recipe.eval_scorer`)."""
    table = scoring_view(read_rollouts(storage, rollouts, columns=SCORED_COLUMNS))
    ok = np.zeros(table.num_rows)
    domains: list[str | None] = [None] * table.num_rows
    parts = domain_parts(recipe, metadata(table))
    for domain, idx in parts:
        sub = table if len(parts) == 1 else table.take(idx)
        name, params = recipe.eval_scorer(domain)
        scores = run_scorer(build_scorer(name, **params), score_batch(
            sub, prompt_images=reads([name], "image"), transcripts=reads([name], "transcript"))).scores
        ok[idx] = (scores >= 1.0).astype(np.float64)
        for i in idx:
            domains[i] = domain
    return table.column("group_id").to_pylist(), ok, domains


def eval_metrics(storage: RunStorage, recipe: Recipe, greedy: list[str], sampled: list[str],
                 split: str = "dev") -> dict[str, float]:
    """Greedy accuracy, avg@k and pass@k over the split, and per domain of a mixture
    (`<prefix>/<domain>/accuracy`, ...)."""
    k, p = recipe.eval.k, PREFIX[split]
    _, greedy_ok, greedy_domains = correctness(storage, recipe, greedy)
    groups, ok, domains = correctness(storage, recipe, sampled)

    def scores(prefix: str, g_ok: np.ndarray, s_groups: list[str], s_ok: np.ndarray) -> dict[str, float]:
        per_prompt: dict[str, list[float]] = {}
        for g, c in zip(s_groups, s_ok):
            per_prompt.setdefault(g, []).append(c)
        return {f"{prefix}/accuracy": float(g_ok.mean()), f"{prefix}/avg_at_{k}": float(s_ok.mean()),
                f"{prefix}/pass_at_{k}": float(np.mean([max(v) for v in per_prompt.values()])),
                f"{prefix}/prompts": float(len(g_ok))}

    out = {**scores(p, greedy_ok, groups, ok), **agent_eval_metrics(storage, sampled, p)}
    for domain in dict.fromkeys(d for d in greedy_domains if d is not None):
        g_idx = [i for i, d in enumerate(greedy_domains) if d == domain]
        s_idx = [i for i, d in enumerate(domains) if d == domain]
        out.update(scores(f"{p}/{domain}", greedy_ok[g_idx], [groups[i] for i in s_idx], ok[s_idx]))
    return out


def agent_eval_metrics(storage: RunStorage, sampled: list[str], prefix: str) -> dict[str, float]:
    """An agent's tool use on the held-out prompts' sampled trajectories: assistant turns per
    trajectory (`<prefix>/turns_mean`) and the share of tool calls that gave a result
    (`<prefix>/tool_success`); nothing for rows that are not trajectories."""
    table = read_rollouts(storage, sampled, columns=["agent_turns", "agent_tool_calls", "agent_tool_errors"])
    if "agent_turns" not in table.schema.names:
        return {}

    turns, calls, errors = (sum(table.column(c).to_pylist()) for c in ("agent_turns", "agent_tool_calls", "agent_tool_errors"))
    return tool_use(prefix, table.num_rows, turns, calls, errors)


def metrics_line(recipe: Recipe, m: dict[str, float], split: str = "dev") -> str:
    """`accuracy 0.250  avg@4 0.312  pass@4 0.500  (16 prompts)` of an evaluation's metrics."""
    k, p = recipe.eval.k, PREFIX[split]
    agent = (f"  turns {m[f'{p}/turns_mean']:.2f}  tool ok {m[f'{p}/tool_success']:.2f}"
             if f"{p}/turns_mean" in m else "")  # an agent's sampled trajectories
    domains = [key.split("/")[1] for key in m if key.startswith(f"{p}/") and key.endswith("/accuracy") and key.count("/") == 2]
    scores = [f"{d} {m[p + '/' + d + '/accuracy']:.3f}" for d in domains]  # a mixture's, per domain
    per_domain = f"  [{', '.join(scores)}]" if scores else ""
    return (f"accuracy {m[f'{p}/accuracy']:.3f}  avg@{k} {m[f'{p}/avg_at_{k}']:.3f}  pass@{k} {m[f'{p}/pass_at_{k}']:.3f}"
            f"{agent}  ({int(m[f'{p}/prompts'])} prompts){per_domain}")

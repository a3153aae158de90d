"""The data stages of one iteration, each reading committed inputs and committing its outputs
with a manifest (idempotent: a committed stage is returned, not recomputed).

requests.arrow -> (worker group) rollouts/part-*.arrow -> rewards.arrow -> advantages.arrow
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from stages.advantage import group_advantages, group_stats
from stages.data import build_prompt_source
from stages.recipe import Recipe
from stages.rewards.base import ScoreBatch, aggregate, build_scorer, run_scorer
from stages.sample import metadata, read_rollouts, read_shard, table_from_rows, write_shard
from stages.storage import RunStorage, iter_dir, join


def decode_png(data: bytes):
    """PNG bytes of a shard -> RGB PIL image."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def committed(storage: RunStorage, iteration: int, stage: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the stage's committed manifest, or run `make` and commit what it returns."""
    found = storage.stage_manifest(iteration, stage)
    if found is not None:
        return {**found, "reused": True}
    start = time.perf_counter()
    manifest = make()
    manifest.setdefault("seconds", time.perf_counter() - start)
    storage.commit_stage(iteration, stage, manifest)
    return {**manifest, "reused": False}


def write_requests(storage: RunStorage, recipe: Recipe, iteration: int) -> dict[str, Any]:
    """The iteration's prompt groups; the data position is the iteration number."""
    source = build_prompt_source(recipe.data)
    prompts = source.batch(iteration, recipe.rollout.prompts_per_iteration)
    rows = [
        {"group_id": f"{iter_dir(iteration)}/{p.prompt_id}", "prompt": p.text, "metadata": p.metadata,
         "group_size": recipe.rollout.group_size, "iteration": iteration}
        for p in prompts
    ]
    rel = join(iter_dir(iteration), "requests.arrow")
    write_shard(storage, rel, table_from_rows(rows, "requests"))
    return {"files": [rel], "rows": len(rows)}


def score(storage: RunStorage, recipe: Recipe, iteration: int, rollouts: list[str], scorers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score every rollout with the recipe's scorers; write rewards.arrow with components."""
    table = read_rollouts(storage, rollouts)
    names = table.schema.names
    batch = ScoreBatch(
        sample_ids=table.column("sample_id").to_pylist(),
        prompts=table.column("prompt").to_pylist(),
        texts=table.column("text").to_pylist() if "text" in names else None,
        images=[decode_png(b) for b in table.column("media_png").to_pylist()] if "media_png" in names else None,
        metadata=metadata(table),
        finish_reasons=table.column("finish_reason").to_pylist() if "finish_reason" in names else None,
    )
    results, weights = {}, {}
    for spec in recipe.reward.scorers:
        scorer = (scorers or {}).get(spec.name) or build_scorer(spec.name, **spec.params)
        results[spec.name] = run_scorer(scorer, batch)
        weights[spec.name] = spec.weight
    total = aggregate(results, weights, recipe.reward.aggregation)
    rows = []
    for i, sid in enumerate(batch.sample_ids):
        row = {"sample_id": sid, "group_id": table.column("group_id")[i].as_py(), "reward": float(total.scores[i])}
        row.update({f"reward/{k}": float(v[i]) for k, v in total.components.items()})
        rows.append(row)
    rel = join(iter_dir(iteration), "rewards.arrow")
    write_shard(storage, rel, table_from_rows(rows, "rewards"))
    stats = group_stats(total.scores, table.column("group_id").to_pylist())
    metrics = {
        "rollout/reward_mean": float(np.mean(total.scores)),
        "rollout/reward_std": float(np.std(total.scores)),
        "rollout/zero_std_group_frac": stats["zero_std_group_frac"],
    }
    if "response_ids" in names:
        metrics["rollout/response_len_mean"] = float(np.mean([len(r) for r in table.column("response_ids").to_pylist()]))
        metrics["rollout/truncated_frac"] = float(np.mean([r == "length" for r in batch.finish_reasons]))
    metrics.update({f"rollout/reward/{k}": float(np.mean(v)) for k, v in total.components.items()})
    return {"files": [rel], "rows": len(rows), "metrics": metrics}


def advantages(storage: RunStorage, recipe: Recipe, iteration: int, rewards: str) -> dict[str, Any]:
    """Group-relative advantages from rewards.arrow (DESIGN.md section 5)."""
    table = read_shard(storage, rewards, "rewards")
    a = recipe.advantage
    adv = group_advantages(
        table.column("reward").to_numpy(), table.column("group_id").to_pylist(),
        scope=a.scope, normalize=a.normalize, use_global_std=a.use_global_std, eps=a.eps,
    )
    rows = [
        {"sample_id": s, "group_id": g, "advantage": float(x)}
        for s, g, x in zip(table.column("sample_id").to_pylist(), table.column("group_id").to_pylist(), adv.tolist())
    ]
    rel = join(iter_dir(iteration), "advantages.arrow")
    write_shard(storage, rel, table_from_rows(rows, "advantages"))
    values = adv.numpy()
    return {
        "files": [rel], "rows": len(rows),
        "metrics": {"advantage/mean": float(values.mean()), "advantage/std": float(values.std()),
                    "advantage/abs_mean": float(np.abs(values).mean())},
    }

"""The data stages of one iteration, each reading committed inputs and committing its outputs
with a manifest (idempotent: a committed stage is returned, not recomputed).

requests.arrow -> (worker group) rollouts/part-*.arrow -> rewards.arrow -> advantages.arrow
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from unirl.stages.distill import distills_tokens, domain_parts
from unirl.stages.kernels.advantage import group_advantages, group_stats
from unirl.stages.recipe import Recipe
from unirl.stages.rewards.base import ScoreBatch, ScoreResult, aggregate, build_scorer, prompt_check, run_scorer, scorer_reads
from unirl.stages.rewards.overlong import apply_overlong
from unirl.stages.runtime.data import build_prompt_source
from unirl.stages.runtime.faults import fault_point
from unirl.stages.runtime.images import decode, with_image_grids
from unirl.stages.runtime.media import decode_frames, decode_png
from unirl.stages.runtime.sample import metadata, read_rollouts, read_shard, scoring_view, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, committed_batch, iter_dir, join  # noqa: F401 (committed_batch re-exported)


def committed(storage: RunStorage, iteration: int, stage: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the stage's committed manifest, or run `make` and commit what it returns."""
    found = storage.stage_manifest(iteration, stage)
    if found is not None:
        return {**found, "reused": True}
    start = time.perf_counter()
    manifest = make()
    manifest.setdefault("seconds", time.perf_counter() - start)
    fault_point(stage.split("-")[0], iteration)  # the worst moment to die: work done, nothing committed
    storage.commit_stage(iteration, stage, manifest)
    return {**manifest, "reused": False}


def round_suffix(round_index: int) -> str:
    """File/stage suffix of a dynamic-sampling refill round ("" for the first round)."""
    return f"-r{round_index}" if round_index else ""


def write_requests(storage: RunStorage, recipe: Recipe, iteration: int, round_index: int = 0) -> dict[str, Any]:
    """The iteration's prompt groups; the data position is the iteration number. Refill round r
    takes the next `prompts_per_iteration` prompts of the same iteration's stream."""
    source = build_prompt_source(recipe.data)
    n = recipe.rollout.prompts_per_iteration
    prompts = source.batch(iteration, n * (round_index + 1))[n * round_index:]
    check_prompts(recipe, prompts)
    rows = request_rows(recipe, prompts, iter_dir(iteration), recipe.rollout.group_size, iteration)
    rel = join(iter_dir(iteration), f"requests{round_suffix(round_index)}.arrow")
    write_shard(storage, rel, table_from_rows(rows, "requests"))
    return {"files": [rel], "rows": len(rows)}


def request_rows(recipe: Recipe, prompts: list[Any], prefix: str, group_size: int, iteration: int) -> list[dict[str, Any]]:
    """One requests row per prompt (group id `prefix/prompt_id`); with the prompt's images and
    their patch grids when the model family takes images (stages/runtime/images.py)."""
    rows = [{"group_id": f"{prefix}/{p.prompt_id}", "prompt": p.text, "metadata": p.metadata,
             "group_size": group_size, "iteration": iteration} for p in prompts]
    return with_image_grids(recipe, rows, [p.images for p in prompts], [f"prompt {p.prompt_id!r}" for p in prompts])


def check_prompts(recipe: Recipe, prompts: list[Any]) -> None:
    """Fail before sampling when a scorer of the recipe (of a mixture's prompt: its domain's)
    cannot score one of `prompts`, naming it."""
    for p in prompts:
        for spec in recipe.scorers(p.metadata.get("domain")):
            check = prompt_check(spec.name)
            if check is None:
                continue
            try:
                check(p.text)
            except ValueError as exc:
                raise ValueError(f"prompt {p.prompt_id!r}: scorer {spec.name!r} cannot score it: {exc}") from None


# What scoring reads of a rollouts table (not the latents).
SCORED_COLUMNS = ["sample_id", "group_id", "prompt", "text", "media_png", "media_frames", "images", "metadata",
                  "finish_reason", "response_ids", "agent_transcript"]


def score_batch(table: Any, prompt_images: bool = True, transcripts: bool = True) -> ScoreBatch:
    """What scorers see of a rollouts table: texts (AR), decoded PNG images (image diffusion),
    decoded frames (video diffusion: `videos`, one list of frames per sample), or the answer and,
    with `prompt_images`, the first image its prompt showed (vision-language models); an agent's
    trajectories too with `transcripts`."""
    names = table.schema.names
    pngs = table.column("media_png").to_pylist() if "media_png" in names else None
    clips = table.column("media_frames").to_pylist() if "media_frames" in names else None
    images = None
    if pngs is not None and all(b is not None for b in pngs):
        images = [decode_png(b) for b in pngs]
    elif "images" in names and prompt_images:
        images = [decode(shown[0], f"sample {sid!r}: image 0") for sid, shown in
                  zip(table.column("sample_id").to_pylist(), table.column("images").to_pylist())]
    return ScoreBatch(
        sample_ids=table.column("sample_id").to_pylist(),
        prompts=table.column("prompt").to_pylist(),
        texts=table.column("text").to_pylist() if "text" in names else None,
        images=images,
        videos=[decode_frames(c) for c in clips] if clips is not None and all(c for c in clips) else None,
        metadata=metadata(table),
        finish_reasons=table.column("finish_reason").to_pylist() if "finish_reason" in names else None,
        transcripts=([json.loads(t) for t in table.column("agent_transcript").to_pylist()]
                     if transcripts and "agent_transcript" in names else None),
    )


def reads(scorers: list[str], media: str) -> bool:
    """Whether one of `scorers` reads `media` (a remote scorer may: its server decides)."""
    return any(media in (scorer_reads(name) or (media,)) for name in scorers)


def score(
    storage: RunStorage, recipe: Recipe, iteration: int, rollouts: list[str],
    scorers: dict[str, Any] | None = None, round_index: int = 0,
) -> dict[str, Any]:
    """Score every rollout with its scorers (the recipe's; a mixture's domain's own); write
    rewards.arrow with components (and each row's `domain` in a mixture)."""
    table = scoring_view(read_rollouts(storage, rollouts, columns=SCORED_COLUMNS))
    names = table.schema.names
    n = table.num_rows
    parts = domain_parts(recipe, metadata(table))
    scores = np.zeros(n)
    components: dict[str, np.ndarray] = {}
    finish: list[str] | None = None
    for domain, idx in parts:
        sub = table if len(parts) == 1 else table.take(idx)
        specs = recipe.scorers(domain)
        spec_names = [s.name for s in specs]
        batch = score_batch(sub, prompt_images=reads(spec_names, "image"), transcripts=reads(spec_names, "transcript"))
        results, weights = {}, {}
        for spec in specs:
            scorer = (scorers or {}).get(spec.component) if domain is None else None
            results[spec.component] = run_scorer(scorer or build_scorer(spec.name, **spec.params), batch)
            weights[spec.component] = spec.weight
        total = aggregate(results, weights, recipe.reward.aggregation)
        overlong = recipe.reward.overlong
        if overlong.truncated != "keep" and "response_ids" in names:
            assert batch.finish_reasons is not None, "text rollouts record their finish reasons"
            capped, added = apply_overlong(
                total.scores, [len(r) for r in sub.column("response_ids").to_pylist()], batch.finish_reasons,
                mode=overlong.truncated, max_new_tokens=recipe.rollout.max_new_tokens,
                buffer=overlong.buffer, penalty=overlong.penalty,
            )
            total = ScoreResult(capped, {**total.components, "overlong": added})
        scores[idx] = total.scores
        for k, v in total.components.items():  # a component a domain does not score is NaN on its rows
            components.setdefault(k, np.full(n, np.nan))[idx] = v
    if "finish_reason" in names:
        finish = table.column("finish_reason").to_pylist()
    domains = [d for d, idx in parts for _ in idx]
    order = [i for _, idx in parts for i in idx]
    domain_of = dict(zip(order, domains))
    rows = []
    for i, sid in enumerate(table.column("sample_id").to_pylist()):
        row = {"sample_id": sid, "group_id": table.column("group_id")[i].as_py(), "reward": float(scores[i])}
        row.update({f"reward/{k}": None if np.isnan(v[i]) else float(v[i]) for k, v in components.items()})
        if domain_of[i] is not None:
            row["domain"] = domain_of[i]
        rows.append(row)
    rel = join(iter_dir(iteration), f"rewards{round_suffix(round_index)}.arrow")
    write_shard(storage, rel, table_from_rows(rows, "rewards"))
    groups = table.column("group_id").to_pylist()
    stats = group_stats(scores, groups)
    metrics = {
        "rollout/reward_mean": float(np.mean(scores)),
        "rollout/reward_std": float(np.std(scores)),
        "rollout/zero_std_group_frac": stats["zero_std_group_frac"],
    }
    if "response_ids" in names:
        assert finish is not None, "text rollouts record their finish reasons"
        metrics["rollout/response_len_mean"] = float(np.mean([len(r) for r in table.column("response_ids").to_pylist()]))
        metrics["rollout/truncated_frac"] = float(np.mean([r == "length" for r in finish]))
    metrics.update({f"rollout/reward/{k}": float(np.nanmean(v)) for k, v in components.items() if not np.isnan(v).all()})
    for domain, idx in parts:
        if domain is not None:  # per domain: its reward and its groups' signal
            part = group_stats(scores[idx], [groups[i] for i in idx])
            metrics[f"rollout/{domain}/reward_mean"] = float(np.mean(scores[idx]))
            metrics[f"rollout/{domain}/zero_std_group_frac"] = part["zero_std_group_frac"]
    informative = stats["num_groups"] * (1.0 - stats["zero_std_group_frac"])
    return {"files": [rel], "rows": len(rows), "metrics": metrics, "informative_groups": int(round(informative))}


def advantages(storage: RunStorage, recipe: Recipe, iteration: int, rewards: list[str],
               rollouts: list[str] | None = None, teachers: list[str] | None = None) -> dict[str, Any]:
    """Group-relative advantages from the rewards of every round (docs/architecture.md, "The math contract"), computed
    per domain in a mixture (a domain's batch statistics never mix with another's). With dynamic
    sampling, groups whose rewards are all equal are dropped and at most `prompts_per_iteration`
    informative groups are kept, in round order. With `distill`, per-token advantages from the
    teachers' log-probs (`teachers`: their shards) of the student's tokens (`rollouts`)
    (stages/run/distillation.py)."""
    import pyarrow as pa  # start-up time: pyarrow loads on first use, not when a recipe is read

    table = pa.concat_tables([read_shard(storage, r, "rewards") for r in rewards], promote_options="default")
    a = recipe.advantage
    group_ids, domains = table.column("group_id").to_pylist(), (
        table.column("domain").to_pylist() if "domain" in table.schema.names else [None] * table.num_rows)
    adv = np.zeros(table.num_rows)
    reward = np.asarray(table.column("reward").to_pylist(), dtype=np.float64)
    for domain in dict.fromkeys(domains):
        idx = [i for i, d in enumerate(domains) if d == domain]
        adv[idx] = group_advantages(reward[idx].tolist(), [group_ids[i] for i in idx], scope=a.scope, normalize=a.normalize,
                                    use_global_std=a.use_global_std, eps=a.eps)
    rows = [
        {"sample_id": s, "group_id": g, "advantage": float(x), **({"domain": d} if d is not None else {})}
        for s, g, x, d in zip(table.column("sample_id").to_pylist(), group_ids, adv.tolist(), domains)
    ]
    metrics: dict[str, float] = {}
    if recipe.rollout.dynamic_sampling is not None:
        rewards_of: dict[str, set[float]] = {}
        for g, r in zip(group_ids, reward.tolist()):
            rewards_of.setdefault(g, set()).add(r)
        informative = [g for g in dict.fromkeys(group_ids) if len(rewards_of[g]) > 1]
        keep = set(informative[: recipe.rollout.prompts_per_iteration])
        metrics.update({
            "rollout/dynamic_rounds": float(len(rewards)), "rollout/groups_kept": float(len(keep)),
            "rollout/groups_dropped": float(len(rewards_of) - len(informative)),
        })
        metrics["rollout/no_signal"] = float(not keep)
        if not keep:
            # No group carries a signal after the last round: train on the first round's groups,
            # whose advantages are all 0. Their policy-gradient term is 0, but the step is still a
            # step: AdamW's momentum from earlier steps and its weight decay move the weights, the
            # learning-rate schedule advances, and a KL term (`algorithm.kl_coef` > 0) pulls
            # toward the reference. `rollout/no_signal` is 1 for such an iteration.
            keep = set(list(rewards_of)[: recipe.rollout.prompts_per_iteration])
        rows = [r for r in rows if r["group_id"] in keep]

    if distills_tokens(recipe):
        from unirl.stages.run.distillation import token_advantages  # start-up time: loaded on first use

        metrics.update(token_advantages(storage, recipe, rows, rollouts or [], teachers or []))
    rel = join(iter_dir(iteration), "advantages.arrow")
    write_shard(storage, rel, table_from_rows(rows, "advantages"))
    values = np.array([r["advantage"] for r in rows])
    metrics.update({"advantage/mean": float(values.mean()), "advantage/std": float(values.std()),
                    "advantage/abs_mean": float(np.abs(values).mean())})
    return {"files": [rel], "rows": len(rows), "metrics": metrics}

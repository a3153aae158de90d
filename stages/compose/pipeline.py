"""Prompt-enhancer pipelines: a language model rewrites each prompt (the `ar` part), a flow-matching
model draws each rewrite (the `diffusion` part), and the reward on the image trains the parts.

Each part is a whole one-model run of its own under the pipeline run's folder
(`{run}/parts/ar`, `{run}/parts/diffusion`): its recipe (`part_recipe`: the pipeline's shared
sections with the part's model, sampling, algorithm, optimizer and warm start), worker group,
requests, rollouts, advantages, checkpoints and published weights versions, so either side
resumes, replays and publishes as any run does. The pipeline's own iteration folder holds what
joins them:

    iter-N/requests.arrow           the user's prompts, N rewrites each (the ar group)
    parts/ar/iter-N/rollouts/...    the rewrites (text segments, behaviour log-probs)
    parts/diffusion/iter-N/requests.arrow   one group per rewrite: M images of it (the flow group)
    parts/diffusion/iter-N/rollouts/...     the images (latent segments)
    iter-N/rollouts/composed.arrow  one row per image: its rewrite and its image, each part under its
                                    kind's namespace (stages/runtime/sample.py), `parts` = [text, latent]
    iter-N/rewards.arrow            the image's reward against the user's intent, per composed row
    parts/<side>/iter-N/advantages.arrow   per part, within its own groups (`part_advantages`)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.algorithms.advantage import group_advantages
from unirl.stages.compose import POLICY_OF, SIDES, checks, part_of, parts_errors, per_part_errors, segment_of, sequential_errors
from unirl.stages.recipe import Recipe
from unirl.stages.runtime.sample import composed_table, namespaced, read_rollouts, read_shard, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join

UNSET = ("model", "rollout", "algorithm", "train", "sft")  # a pipeline's parts carry these


def parts_root(recipe: Recipe, run_name: str) -> str:
    """Where the parts' runs live: `{storage.root}/{run}/parts`."""
    return join(recipe.storage.root.rstrip("/"), run_name, "parts")


def part_recipe(recipe: Recipe, side: str, run_name: str) -> Recipe:
    """The one-model recipe of a pipeline part (`part_of`): the part's model, sampling, algorithm,
    optimizer, warm start and data (or the pipeline's). Its storage root is the pipeline run's
    `parts` folder and its run name the side, so `RunStorage(root, side)` is the part's run. The
    drawer samples one group per rewrite; the rewriter's reward is its images' (`part_advantages`)."""
    pe = recipe.pe
    assert pe is not None
    part = getattr(pe, side)
    return part_of(recipe, side, model=part.model, rollout=part.rollout.model_dump(mode="json"),
                   upstream=pe.ar.rollout if side == "diffusion" else None, train=part.train,
                   sft=part.sft.model_dump(mode="json") if part.sft is not None else None, algorithm=part.algorithm,
                   data=part.data or recipe.data, scored=side == "diffusion", storage_root=parts_root(recipe, run_name))


def part_storage(recipe: Recipe, run_name: str, side: str) -> RunStorage:
    return RunStorage(parts_root(recipe, run_name), side, recipe.storage.options)


def trains(recipe: Recipe, side: str) -> bool:
    pe = recipe.pe
    assert pe is not None
    return not (pe.freeze_llm if side == "ar" else pe.freeze_diffusion)


@checks.register("pipeline")
def pipeline_errors(recipe: Recipe) -> list[str]:
    """What `unirl validate` reports of a pipeline recipe, one `field.path: ...` line each."""
    from unirl.stages.models.family import families

    pe = recipe.pe
    assert pe is not None
    errors = per_part_errors(recipe, UNSET, "pe", SIDES, "a prompt-enhancer recipe")
    for side in SIDES:
        family = families.get(getattr(pe, side).model.kind)
        if family.policy != POLICY_OF[side]:
            fits = [n for n, f in families.items() if f.policy == POLICY_OF[side]]
            role = "rewriter" if side == "ar" else "drawer"
            errors.append(f"pe.{side}.model.kind: {family.name!r} is a {family.policy} family; the {role} must be a "
                          f"{POLICY_OF[side]} family (allowed: {', '.join(fits)})")
    for side in SIDES:
        errors += sequential_errors("pe", side, getattr(pe, side).rollout, "a pipeline samples each iteration's parts in order")
    if pe.placement == "shared":
        ar, drawer = pe.ar.train, pe.diffusion.train
        for field in ("nproc_per_node", "backend"):
            if getattr(ar, field) != getattr(drawer, field):
                errors.append(f"pe.diffusion.train.{field}: {getattr(drawer, field)!r}, but pe.ar.train.{field} is "
                              f"{getattr(ar, field)!r}; with pe.placement: shared both parts run on the same ranks, so "
                              "give both the same value (or set pe.placement: separate)")
        for side in SIDES:
            if getattr(pe, side).train.nnodes != 1:
                errors.append(f"pe.{side}.train.nnodes: pe.placement: shared puts both parts in one worker group on one "
                              "machine; set nnodes to 1 (or pe.placement: separate)")
    if pe.freeze_llm and pe.freeze_diffusion:
        errors.append("pe.freeze_llm: both sides are frozen (pe.freeze_diffusion is true too), so nothing trains; "
                      "unfreeze one of them")
    if errors:
        return errors
    errors += recipe.scorer_errors(families.get(pe.diffusion.model.kind).produces, f"pe.diffusion.model.kind "
                                   f"{pe.diffusion.model.kind!r}")
    return errors + parts_errors("pe", SIDES, lambda side: part_recipe(recipe, side, recipe.name))


def flow_requests(ar: RunStorage, ar_files: list[str], flow: RunStorage, iteration: int, group_size: int,
                  rel: str) -> dict[str, Any]:
    """The drawer's requests: one group per rewrite (its group id is the rewrite's sample id, so a
    composed sample's lineage is in its id), `group_size` images each, the rewrite as the prompt and
    the user's prompt's metadata (what the image is scored against) carried along."""
    table = read_rollouts(ar, ar_files, columns=["sample_id", "text", "metadata"])
    rows = [{"group_id": sid, "prompt": text.strip(), "metadata": meta, "group_size": group_size, "iteration": iteration}
            for sid, text, meta in zip(table.column("sample_id").to_pylist(), table.column("text").to_pylist(),
                                       table.column("metadata").to_pylist())]
    write_shard(flow, rel, table_from_rows(rows, "requests"))
    return {"files": [rel], "rows": len(rows)}


def compose(storage: RunStorage, rel: str, ar: RunStorage, ar_files: list[str], flow: RunStorage,
            flow_files: list[str]) -> dict[str, Any]:
    """One composed row per image: the rewrite that caused it and the image, namespaced by kind."""
    from unirl.stages.runtime.sample import PART_COLUMNS, segment_columns

    kinds = [segment_of(side) for side in SIDES]  # [text, latent]
    texts = read_rollouts(ar, ar_files).to_pylist()
    by_id = {r["sample_id"]: r for r in texts}
    rows = []
    for image in read_rollouts(flow, flow_files).to_pylist():
        rewrite = by_id.get(image["group_id"])
        if rewrite is None:
            raise ValueError(f"{flow.url()}: image {image['sample_id']!r} names rewrite {image['group_id']!r}, which "
                             f"{ar.url()} does not hold; rerun the iteration's generate tasks")
        row = {"sample_id": image["sample_id"], "group_id": rewrite["group_id"], "iteration": image["iteration"],
               "policy_version": rewrite["policy_version"], "parts": kinds,
               "metadata": rewrite["metadata"], "prompt": rewrite["prompt"]}
        for kind, part in zip(kinds, (rewrite, image)):
            for name in (*PART_COLUMNS, *segment_columns()[kind]):
                row[namespaced(kind, name)] = part[name]
        rows.append(row)
    return {**write_shard(storage, rel, composed_table(rows, kinds)), "files": [rel]}


def advantage_rows(recipe: Recipe, storage: RunStorage, composed: list[str], rewards: list[str],
                   sides: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Advantage rows of each of `sides` within its own groups (DESIGN.md section 5): an image's
    among the images of its rewrite; a rewrite's, whose reward is the mean of its images',
    among the rewrites of its prompt."""
    table = read_rollouts(storage, composed, columns=["sample_id", "group_id", "text/sample_id", "latent/sample_id"])
    reward_of: dict[str, float] = {}
    for rel in rewards:
        shard = read_shard(storage, rel, "rewards")
        reward_of.update(zip(shard.column("sample_id").to_pylist(), shard.column("reward").to_pylist()))
    image_ids = table.column("sample_id").to_pylist()
    missing = [s for s in image_ids if s not in reward_of]
    if missing:
        raise ValueError(f"{storage.url(rewards[0])}: no reward for sample {missing[0]!r}; rerun the score task")
    rewrite_of = dict(zip(image_ids, table.column("text/sample_id").to_pylist()))
    prompt_of = dict(zip(table.column("text/sample_id").to_pylist(), table.column("group_id").to_pylist()))
    a = recipe.advantage
    per_rewrite: dict[str, list[float]] = {}
    for sid in image_ids:
        per_rewrite.setdefault(rewrite_of[sid], []).append(reward_of[sid])
    groups = {
        "diffusion": (image_ids, [reward_of[s] for s in image_ids], [rewrite_of[s] for s in image_ids]),
        "ar": (list(per_rewrite), [float(np.mean(v)) for v in per_rewrite.values()], [prompt_of[s] for s in per_rewrite]),
    }
    out = {}
    for side in sides:
        ids, values, group_ids = groups[side]
        adv = group_advantages(values, group_ids, scope=a.scope, normalize=a.normalize, use_global_std=a.use_global_std,
                               eps=a.eps).numpy()
        out[side] = [{"sample_id": s, "group_id": g, "advantage": float(x)} for s, g, x in zip(ids, group_ids, adv)]
    return out


def advantage_metrics(rows: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    out = {}
    for side, part in rows.items():
        adv = np.array([r["advantage"] for r in part])
        out.update({f"advantage/{side}/abs_mean": float(np.abs(adv).mean()), f"advantage/{side}/std": float(adv.std())})
    return out


def part_advantages(recipe: Recipe, storage: RunStorage, iteration: int, composed: list[str], rewards: list[str],
                    parts: dict[str, RunStorage]) -> dict[str, Any]:
    """Advantages of each trained part within its own groups (`advantage_rows`), each written to
    the part's run (`advantages.arrow`)."""
    rows = advantage_rows(recipe, storage, composed, rewards, list(parts))
    out: dict[str, Any] = {"files": [], "parts": {}, "metrics": advantage_metrics(rows)}  # files of the parts' runs, by side
    for side, part in parts.items():
        rel = join(iter_dir(iteration), "advantages.arrow")
        write_shard(part, rel, table_from_rows(rows[side], "advantages"))
        part.commit_stage(iteration, "advantage", {"files": [rel], "rows": len(rows[side])})
        out["parts"][side] = rel
    return out

"""Pipelines: models in sequence. The first part samples from the user's prompts, each later part
from the texts of the part before it (a prompt enhancer: a language model rewrites each prompt,
a flow-matching model draws each rewrite), and the reward on the last part's samples trains
every part that is not frozen.

Each part is a whole one-model run of its own under the pipeline run's folder
(`{run}/parts/<name>`): its recipe (`part_recipe`: the pipeline's shared sections with the part's
model, sampling, algorithm, optimizer and warm start), worker group, requests, rollouts,
advantages, checkpoints and published weights versions, so every part resumes, replays and
publishes as any run does. For parts `rewriter` then `drawer`, the pipeline's own iteration
folder holds what joins them:

    parts/rewriter/iter-N/requests.arrow   the user's prompts, N rewrites each (the first part's groups)
    parts/rewriter/iter-N/rollouts/...     the rewrites (text segments, behaviour log-probs)
    parts/drawer/iter-N/requests.arrow     one group per rewrite: M images of it
    parts/drawer/iter-N/rollouts/...       the images (latent segments)
    iter-N/rollouts/composed.arrow  one row per last-part sample with each part's sample that led
                                    to it, under the part's name (stages/runtime/sample.py)
    iter-N/rewards.arrow            the last sample's reward against the user's intent, per composed row
    parts/<name>/iter-N/advantages.arrow   per trained part, within its own groups (`part_advantages`)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.algorithms.advantage import group_advantages
from unirl.stages.compose import (
    chain_errors,
    checks,
    duplicate_errors,
    member,
    members,
    names,
    part_of,
    parts_errors,
    per_part_errors,
    sequential_errors,
    upstream_of,
    where,
)
from unirl.stages.recipe import PipelineConfig, Recipe
from unirl.stages.runtime.sample import composed_table, namespaced, read_rollouts, read_shard, table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join

UNSET = ("model", "rollout", "algorithm", "train", "sft")  # a pipeline's parts carry these


def parts_root(recipe: Recipe, run_name: str) -> str:
    """Where the parts' runs live: `{storage.root}/{run}/parts`."""
    return join(recipe.storage.root.rstrip("/"), run_name, "parts")


def part_recipe(recipe: Recipe, name: str, run_name: str) -> Recipe:
    """The one-model recipe of pipeline part `name` (`part_of`): the part's model, sampling,
    algorithm, optimizer, warm start and data (or the pipeline's). Its storage root is the
    pipeline run's `parts` folder and its run name the part's, so `RunStorage(root, name)` is the
    part's run. A later part samples one group per sample of the part before it; only the last
    part is scored (the others' reward is what they lead to, `part_advantages`)."""
    _, part = member(recipe, name)
    up = upstream_of(recipe, name)
    return part_of(recipe, name, model=part.model, rollout=part.rollout.model_dump(mode="json"),
                   upstream=part_recipe(recipe, up, run_name) if up is not None else None, train=part.train,
                   sft=part.sft.model_dump(mode="json") if part.sft is not None else None, algorithm=part.algorithm,
                   data=part.data or recipe.data, scored=name == names(recipe)[-1], storage_root=parts_root(recipe, run_name))


def part_storage(recipe: Recipe, run_name: str, name: str) -> RunStorage:
    return RunStorage(parts_root(recipe, run_name), name, recipe.storage.options)


def trains(recipe: Recipe, name: str) -> bool:
    return not member(recipe, name)[1].freeze


@checks.register("pipeline")
def pipeline_errors(recipe: Recipe) -> list[str]:
    """What `unirl validate` reports of a pipeline recipe, one `field.path: ...` line each."""
    from unirl.stages.models.family import families

    parts, compose = members(recipe), recipe.compose
    assert isinstance(compose, PipelineConfig)
    errors = duplicate_errors(recipe) + per_part_errors(recipe, UNSET, "a pipeline recipe")
    if errors:
        return errors
    errors += chain_errors(recipe, lambda name: member(recipe, name)[1].rollout.kind)
    for part in parts:
        errors += sequential_errors(recipe, part.name, part.rollout, "a pipeline samples each iteration's parts in order")
    if compose.placement == "shared":
        first = parts[0]
        for part in parts[1:]:
            for field in ("nproc_per_node", "backend"):
                if getattr(part.train, field) != getattr(first.train, field):
                    errors.append(f"{where(recipe, part.name)}.train.{field}: {getattr(part.train, field)!r}, but "
                                  f"{where(recipe, first.name)}.train.{field} is {getattr(first.train, field)!r}; with "
                                  "compose.placement: shared every part runs on the same ranks, so give all the same "
                                  "value (or set compose.placement: separate)")
        for part in parts:
            if part.train.nnodes != 1:
                errors.append(f"{where(recipe, part.name)}.train.nnodes: compose.placement: shared puts every part in one "
                              "worker group on one machine; set nnodes to 1 (or compose.placement: separate)")
    if all(part.freeze for part in parts):
        errors.append(f"compose.parts: every part is frozen ({', '.join(names(recipe))}), so nothing trains; set "
                      "`freeze: false` on one of them")
    if errors:
        return errors
    last = parts[-1]
    errors += recipe.scorer_errors(families.get(last.model.kind).produced_by(last.rollout.kind),
                                   f"{where(recipe, last.name)}.model.kind {last.model.kind!r}")
    return errors + parts_errors(recipe, lambda name: part_recipe(recipe, name, recipe.name))


def next_requests(upstream: RunStorage, files: list[str], storage: RunStorage, iteration: int, group_size: int,
                  rel: str) -> dict[str, Any]:
    """The requests of the part after `upstream`: one group per upstream sample (its group id is
    that sample's id, so a composed sample's lineage is in its ids), `group_size` samples each,
    the upstream sample's text as the prompt and the user's prompt's metadata (what the last
    sample is scored against) carried along."""
    table = read_rollouts(upstream, files, columns=["sample_id", "text", "metadata"])
    rows = [{"group_id": sid, "prompt": text.strip(), "metadata": meta, "group_size": group_size, "iteration": iteration}
            for sid, text, meta in zip(table.column("sample_id").to_pylist(), table.column("text").to_pylist(),
                                       table.column("metadata").to_pylist())]
    write_shard(storage, rel, table_from_rows(rows, "requests"))
    return {"files": [rel], "rows": len(rows)}


def compose(storage: RunStorage, rel: str, chain: list[tuple[str, str, RunStorage, list[str]]]) -> dict[str, Any]:
    """One composed row per sample of the last part, with the sample of every part before it that
    led to it, each under its part's name. `chain`: (name, segment kind, storage, rollout files)
    of each part, in order."""
    from unirl.stages.runtime.sample import PART_COLUMNS, segment_columns

    by_id = [{r["sample_id"]: r for r in read_rollouts(store, files).to_pylist()} for _, _, store, files in chain[:-1]]
    name, _, last, last_files = chain[-1]
    rows = []
    for sample in read_rollouts(last, last_files).to_pylist():
        lineage = [sample]
        for k in range(len(chain) - 2, -1, -1):  # up the chain: each sample's group is the one before it
            parent = by_id[k].get(lineage[0]["group_id"])
            if parent is None:
                raise ValueError(f"{chain[k + 1][2].url()}: sample {lineage[0]['sample_id']!r} names "
                                 f"{lineage[0]['group_id']!r} of part {chain[k][0]!r}, which {chain[k][2].url()} does not "
                                 "hold; rerun the iteration's generate tasks")
            lineage.insert(0, parent)
        root = lineage[0]
        row = {"sample_id": sample["sample_id"], "group_id": root["group_id"], "iteration": sample["iteration"],
               "policy_version": root["policy_version"], "parts": [n for n, _, _, _ in chain],
               "metadata": root["metadata"], "prompt": root["prompt"]}
        for (part, kind, _, _), drawn in zip(chain, lineage):
            for column in (*PART_COLUMNS, *segment_columns()[kind]):
                row[namespaced(part, column)] = drawn[column]
        rows.append(row)
    return {**write_shard(storage, rel, composed_table(rows, [(n, k) for n, k, _, _ in chain])), "files": [rel]}


def advantage_rows(recipe: Recipe, storage: RunStorage, composed: list[str], rewards: list[str],
                   parts: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Advantage rows of each of `parts` within its own groups (DESIGN.md section 5): a last-part
    sample's among the samples of its group (one upstream sample's, or one user prompt's); an
    earlier part's sample, whose reward is the mean of the rewards of the samples drawn from it,
    among the samples of its group."""
    order = names(recipe)
    table = read_rollouts(storage, composed, columns=["sample_id", *(f"{n}/{c}" for n in order for c in ("sample_id", "group_id"))])
    reward_of: dict[str, float] = {}
    for rel in rewards:
        shard = read_shard(storage, rel, "rewards")
        reward_of.update(zip(shard.column("sample_id").to_pylist(), shard.column("reward").to_pylist()))
    leaves = table.column("sample_id").to_pylist()
    missing = [s for s in leaves if s not in reward_of]
    if missing:
        raise ValueError(f"{storage.url(rewards[0])}: no reward for sample {missing[0]!r}; rerun the score task")
    ids = {n: table.column(namespaced(n, "sample_id")).to_pylist() for n in order}
    group_of = {n: dict(zip(ids[n], table.column(namespaced(n, "group_id")).to_pylist())) for n in order}
    values: dict[str, dict[str, float]] = {order[-1]: {s: reward_of[leaf] for s, leaf in zip(ids[order[-1]], leaves)}}
    for k in range(len(order) - 2, -1, -1):  # a sample's reward: the mean of its children's
        children: dict[str, list[float]] = {}
        for child, value in values[order[k + 1]].items():
            children.setdefault(group_of[order[k + 1]][child], []).append(value)
        values[order[k]] = {s: float(np.mean(v)) for s, v in children.items()}
    a = recipe.advantage
    out = {}
    for name in parts:
        samples = list(values[name])
        groups = [group_of[name][s] for s in samples]
        adv = group_advantages([values[name][s] for s in samples], groups, scope=a.scope, normalize=a.normalize,
                               use_global_std=a.use_global_std, eps=a.eps).numpy()
        out[name] = [{"sample_id": s, "group_id": g, "advantage": float(x)} for s, g, x in zip(samples, groups, adv)]
    return out


def advantage_metrics(rows: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    out = {}
    for name, part in rows.items():
        adv = np.array([r["advantage"] for r in part])
        out.update({f"advantage/{name}/abs_mean": float(np.abs(adv).mean()), f"advantage/{name}/std": float(adv.std())})
    return out


def part_advantages(recipe: Recipe, storage: RunStorage, iteration: int, composed: list[str], rewards: list[str],
                    parts: dict[str, RunStorage]) -> dict[str, Any]:
    """Advantages of each trained part within its own groups (`advantage_rows`), each written to
    the part's run (`advantages.arrow`)."""
    rows = advantage_rows(recipe, storage, composed, rewards, list(parts))
    out: dict[str, Any] = {"files": [], "parts": {}, "metrics": advantage_metrics(rows)}  # files of the parts' runs, by name
    for name, part in parts.items():
        rel = join(iter_dir(iteration), "advantages.arrow")
        write_shard(part, rel, table_from_rows(rows[name], "advantages"))
        part.commit_stage(iteration, "advantage", {"files": [rel], "rows": len(rows[name])})
        out["parts"][name] = rel
    return out

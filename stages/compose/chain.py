"""What every composed shape shares along its chain of parts: the requests of a part from the
samples of the one before it, the composed rows (one per last-part sample, with every part's
sample that led to it, under the part's name; stages/runtime/sample.py), and the advantages of
each part within its own groups, rewards propagating up the lineage (docs/architecture.md, "The math contract")."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unirl.stages.compose import names
from unirl.stages.runtime.sample import (
    PART_COLUMNS,
    composed_table,
    namespaced,
    read_rollouts,
    read_shard,
    segment_columns,
    table_from_rows,
    write_shard,
)
from unirl.stages.runtime.storage import RunStorage

if TYPE_CHECKING:
    from unirl.stages.recipe import Recipe


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
    """Advantage rows of each of `parts` within its own groups (docs/architecture.md, "The math contract"): a last-part
    sample's among the samples of its group (one upstream sample's, or one user prompt's); an
    earlier part's sample, whose reward is the mean of the rewards of the samples drawn from it,
    among the samples of its group."""
    import numpy as np  # start-up time: loaded on first use, not when a recipe is read

    from unirl.stages.kernels.advantage import group_advantages

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
    import numpy as np  # start-up time: loaded on first use, not when a recipe is read

    out = {}
    for name, part in rows.items():
        adv = np.array([r["advantage"] for r in part])
        out.update({f"advantage/{name}/abs_mean": float(np.abs(adv).mean()), f"advantage/{name}/std": float(adv.std())})
    return out

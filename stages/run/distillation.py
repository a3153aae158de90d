"""On-policy distillation's advantage for text families (docs/distillation.md).

The student sampled response y ~ pi_s(. | x) and recorded log pi_s(y_t | x, y_<t) for every
token (`response_logprobs`, the behaviour record); its teacher scored the same tokens (the teacher
stage: log pi_T(y_t | x, y_<t)). Per token

    d_t = log pi_T(y_t | ...) - log pi_s(y_t | ...)

is minus the one-sample estimate of the reverse KL KL(pi_s || pi_T) at position t; training the
policy gradient with advantage A_t = coef * d_t lowers the reverse KL on the student's own
samples (mode: pure), and A_t = A + coef * d_t adds it to the algorithm's group advantage A
(mode: additive, slime's form). A row without a teacher (additive only) keeps A on every token.
Each row records its teacher (`teacher`), its per-token advantages (`token_advantages`) and, as
`advantage`, their mean over its tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from unirl.stages.runtime.sample import read_rollouts, read_shard
from unirl.stages.runtime.storage import RunStorage


def distill_signal(student: list[float], teacher: list[float], *, mode: str, coef: float, advantage: float) -> list[float]:
    """Per-token advantages of one row: coef*(teacher - student) (pure), plus `advantage` (additive)."""
    if len(student) != len(teacher):
        raise ValueError(f"the teacher scored {len(teacher)} tokens, the student sampled {len(student)}")
    base = advantage if mode == "additive" else 0.0
    return [base + coef * (t - s) for s, t in zip(student, teacher)]


def token_advantages(storage: RunStorage, recipe: Any, rows: list[dict[str, Any]], rollouts: list[str],
                     teachers: list[str]) -> dict[str, float]:
    """Set each advantages row's `token_advantages`, `teacher` and `advantage` (their mean) from
    the teachers' shards `teachers` and the student's record in `rollouts`; the distillation
    metrics: `distill/reverse_kl` (mean over taught tokens of log pi_s - log pi_T), per domain
    `distill/<domain>/reverse_kl`, and `distill/taught_frac` (rows with a teacher)."""
    d = recipe.distill
    student = read_rollouts(storage, rollouts, columns=["sample_id", "response_logprobs"])
    own = dict(zip(student.column("sample_id").to_pylist(), student.column("response_logprobs").to_pylist()))
    scored: dict[str, tuple[str, list[float]]] = {}
    for rel in teachers:
        shard = read_shard(storage, rel, "teacher")
        for sid, name, lps in zip(shard.column("sample_id").to_pylist(), shard.column("teacher").to_pylist(),
                                  shard.column("teacher_logprobs").to_pylist()):
            scored[sid] = (name, lps)
    gaps: dict[str | None, list[float]] = {}
    taught = 0
    for row in rows:
        sid = row["sample_id"]
        if sid not in own:
            raise ValueError(f"sample {sid!r}: in the rewards but not in the rollouts {rollouts}")
        lps = own[sid]
        if sid in scored:
            name, theirs = scored[sid]
            try:
                values = distill_signal(lps, theirs, mode=d.mode, coef=d.coef, advantage=row["advantage"])
            except ValueError as exc:
                raise ValueError(f"sample {sid!r}, teacher {name!r}: {exc}") from None
            row["teacher"] = name
            gap = [s - t for s, t in zip(lps, theirs)]
            gaps.setdefault(row.get("domain"), []).extend(gap)
            taught += 1
        elif d.mode == "pure":
            raise ValueError(f"sample {sid!r}: pure distillation, but no teacher scored it (domain "
                             f"{row.get('domain')!r}); the teacher stage's shards {teachers} miss it")
        else:
            values = [row["advantage"]] * len(lps)
        row["token_advantages"] = values
        row["advantage"] = float(np.mean(values)) if values else 0.0
    every = [g for v in gaps.values() for g in v]
    metrics = {"distill/taught_frac": taught / max(len(rows), 1)}
    if every:
        metrics["distill/reverse_kl"] = float(np.mean(every))
    for domain, values in gaps.items():
        if domain is not None and values:
            metrics[f"distill/{domain}/reverse_kl"] = float(np.mean(values))
    return metrics

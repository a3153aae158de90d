"""On-policy distillation's data (docs/distillation.md): which teacher teaches which row, where
each teacher's weights are, the recipe a teacher trained at the run's start is trained with, and
the rules `unirl validate` checks.

Routing: a row's teacher is its domain's `teacher` (a `data: {name: mixture}` recipe), else
`distill.teacher`, else the only teacher; a row with none gets no distillation signal. The routing
is a function of the recipe and the row's domain (recorded in its metadata), so a resumed run
routes every row as the killed one did; the teacher stage records it per row (`teacher`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.stages.runtime.registry import algorithms, engines, policies
from unirl.stages.runtime.storage import RunStorage
from unirl.stages.runtime.tokenizer import build_char_tokenizer, load_tokenizer

TEACHER_RUN = "{run}.teacher-{name}"  # the run folder of a teacher trained at the run's start


def domains(recipe: Any) -> list[Any]:
    """The recipe's domains (`data.domains` of a mixture), else []."""
    return list(getattr(recipe.data, "domains", None) or [])


def domain_names(recipe: Any) -> list[str]:
    return [d.name for d in domains(recipe)]


def teacher_of(recipe: Any, domain: str | None) -> str | None:
    """The name of the teacher of a row of `domain` (None: no distillation signal for it)."""
    d = recipe.distill
    if d is None:
        return None
    for dom in domains(recipe):
        if dom.name == domain and dom.teacher is not None:
            return str(dom.teacher)
    if d.teacher is not None:
        return str(d.teacher)
    return d.teachers[0].name if len(d.teachers) == 1 else None


def teacher_domain(recipe: Any, teacher: Any) -> Any:
    """The `data` section a teacher trained with `sft` learns from: its `domain`'s, the domain
    naming it, or a single-source run's `data`."""
    doms = domains(recipe)
    if not doms:
        return recipe.data
    name = teacher.domain or next((d.name for d in doms if d.teacher == teacher.name), None)
    return next(d.data for d in doms if d.name == name)


def teacher_run(run_name: str, teacher: str) -> str:
    return TEACHER_RUN.format(run=run_name, name=teacher)


def teacher_recipe(recipe: Any, teacher: Any) -> Any:
    """The recipe a teacher with `sft` is trained by: the run's model (with `tiny` overrides), its
    domain's data, its own `sft`; no distillation, no agent."""
    model = recipe.model
    if teacher.tiny:
        model = model.model_copy(update={"tiny": type(model.tiny).model_validate({**model.tiny.model_dump(), **teacher.tiny})})
    warm = getattr(model, "vae_warmup", None)
    if teacher.init == "student" and warm is not None:  # the student's VAE is kept: its latent space is the student's
        model = model.model_copy(update={"vae_warmup": warm.model_copy(update={"steps": 0})})
    data = teacher_domain(recipe, teacher)
    domain = next((d.name for d in domains(recipe) if d.data is data), None)
    algorithm = recipe.algorithm
    if algorithms.get(algorithm.name).needs_teacher:  # a teacher has no teacher: another algorithm of its segment,
        segment = algorithms.get(algorithm.name).segment  # one that leaves the sampler as it is (the teacher never runs it)
        algorithm = next(cls for _, cls in algorithms.items() if cls.segment == segment and not cls.needs_teacher
                         and not cls.sampler_defaults() and not cls.samples_with_ema).config()
    return recipe.model_copy(update={
        "model": model, "data": data, "sft": teacher.sft, "distill": None, "agent": None, "algorithm": algorithm,
        "name": f"{recipe.name}-teacher-{teacher.name}",
        "reward": recipe.reward.model_copy(update={"scorers": recipe.scorers(domain)}),
        # evaluated where it lives, in its own worker group (a dedicated engine serves the student)
        "rollout": recipe.rollout.model_copy(update={"engine": engines.get("trainside").config(), "mode": "sync",
                                                     "correction": None}),
        "train": recipe.train.model_copy(update={"accumulate_rollouts": 1})})


def teacher_folders(recipe: Any, run_name: str) -> dict[str, str | tuple[str, str]]:
    """Each teacher's weights: a local folder (`path`), or (run folder, run-relative weights) of
    one trained at the run's start."""
    out: dict[str, str | tuple[str, str]] = {}
    for t in recipe.distill.teachers if recipe.distill is not None else []:
        if t.path is not None:
            out[t.name] = t.path
        else:
            store = RunStorage(recipe.storage.root, teacher_run(run_name, t.name), recipe.storage.options)
            out[t.name] = (store.run, store.weights_rel(0))
    return out


def vocabulary(model: Any) -> tuple[str, dict[str, int]] | None:
    """(what it is, its token -> id map) of a text model section's tokenizer: the folder's
    (`path`), or the tiny model's character tokenizer; None where there is none to compare yet."""
    path = getattr(model, "path", None)
    if path:
        folder = Path(path)
        if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            return None
        return f"the tokenizer of {path}", dict(load_tokenizer(folder).get_vocab())
    charset = getattr(getattr(model, "tiny", None), "charset", None)
    if charset is None:
        return None
    return f"the tiny model's character tokenizer ({charset!r})", dict(build_char_tokenizer(charset).get_vocab())


def distill_errors(recipe: Any, policy: Any, algo: Any, *, local_files: bool = True) -> list[str]:
    """What a recipe's `distill` section and its domains' teachers must satisfy (`local_files`: also
    that each teacher folder is a model folder with the student's tokenizer)."""
    errors: list[str] = []
    d = recipe.distill
    names = [t.name for t in d.teachers] if d is not None else []
    for i, dom in enumerate(domains(recipe)):
        if dom.teacher is not None and dom.teacher not in names:
            errors.append(f"data.domains.{i}.teacher: {dom.teacher!r} is not one of distill.teachers "
                          f"({', '.join(names) or 'none: add a distill section'})")
    if d is None:
        return errors
    if recipe.agent is not None:
        errors.append("distill: on-policy distillation of multi-turn agent trajectories is not built; remove `agent` or "
                      "`distill`")
    if recipe.rollout.dynamic_sampling is not None:
        errors.append("distill: with dynamic sampling the kept groups depend on the rewards; distillation gives every "
                      "sample a signal, so remove rollout.dynamic_sampling")
    if not algo.distills:
        fits = "an algorithm that takes per-token advantages (grpo, drpo)" if policy.segment == "text" else "flow_opd"
        errors.append(f"algorithm.name: {algo.name!r} cannot train on-policy distillation of {policy.segment} "
                      f"segments; use {fits}")
    doms = domain_names(recipe)
    for i, t in enumerate(d.teachers):
        if t.domain is not None and t.domain not in doms:
            errors.append(f"distill.teachers.{i}.domain: {t.domain!r} is not a domain of data "
                          f"({', '.join(doms) or 'the data is a single source: remove `domain`'})")
        elif t.sft is not None and doms and t.domain is None and not any(x.teacher == t.name for x in domains(recipe)):
            errors.append(f"distill.teachers.{i}: teacher {t.name!r} is trained with `sft`, but no domain names it; "
                          "set its `domain`")
        if t.init == "student" and t.tiny and policy.segment != "latent":
            errors.append(f"distill.teachers.{i}.tiny: a teacher with `init: student` starts from the student's weights, "
                          "so it has the student's architecture; remove `tiny` or use `init: base`")
        if t.path is not None and local_files:
            folder = Path(t.path)
            if not folder.is_dir() or not any((folder / f).is_file() for f in ("config.json", "model_index.json")):
                errors.append(f"distill.teachers.{i}.path: {t.path!r} is not a model folder (no config.json or "
                              "model_index.json); give the local folder of a model that model.kind loads")
    if d.mode == "pure":
        untaught = [dom.name for dom in domains(recipe) if teacher_of(recipe, dom.name) is None]
        if untaught:
            errors.append(f"distill.mode: pure distillation needs a teacher for every domain; {', '.join(untaught)} "
                          "has none (name one in its `teacher`, set distill.teacher, or use mode: additive)")
        elif not domains(recipe) and teacher_of(recipe, None) is None:
            errors.append("distill.teacher: several teachers and a single data source; name the one that teaches it")
    if policy.segment == "text" and not errors and local_files:
        errors += tokenizer_errors(recipe)
    return errors


def tokenizer_errors(recipe: Any) -> list[str]:
    """A teacher must tokenize as the student does (its log-probs are of the student's token ids)."""
    student = vocabulary(recipe.model)
    if student is None:
        return []
    out = []
    for i, t in enumerate(recipe.distill.teachers):
        if t.path is not None:
            model: Any = recipe.model.model_copy(update={"path": t.path})
        elif t.tiny:
            model = teacher_recipe(recipe, t).model
        else:
            continue
        theirs = vocabulary(model)
        if theirs is not None and theirs[1] != student[1]:
            out.append(f"distill.teachers.{i}: teacher {t.name!r} has {theirs[0]} ({len(theirs[1])} tokens), the student "
                       f"{student[0]} ({len(student[1])} tokens); a teacher scores the student's token ids, so it must "
                       "share the student's tokenizer")
    return out


def domain_parts(recipe: Any, metas: list[dict[str, Any]]) -> list[tuple[str | None, list[int]]]:
    """Row indices by domain, in the recipe's domain order: [(None, every row)] for a single
    source; a mixture's row that names no domain of the recipe is an error naming it."""
    names = domain_names(recipe)
    if not names:
        return [(None, list(range(len(metas))))]
    by: dict[str, list[int]] = {n: [] for n in names}
    for i, meta in enumerate(metas):
        domain = meta.get("domain")
        if domain not in by:
            raise ValueError(f"row {i}: its metadata names domain {domain!r}, not one of data.domains "
                             f"({', '.join(names)}); was it sampled by another recipe?")
        by[domain].append(i)
    return [(n, idx) for n, idx in by.items() if idx]


def distills_tokens(recipe: Any) -> bool:
    """Whether the run's advantages take its teachers' token log-probs (a text run's distillation);
    a flow run's teachers work inside its train step (flow_opd), after plain advantages."""
    return recipe.distill is not None and policies.get(recipe.rollout.kind).segment == "text"


def taught_by(recipe: Any) -> list[str]:
    """The teachers whose log-probs a text run's advantages take (those some row is routed to, in
    the recipe's order); a flow run's teachers work inside its train step (flow_opd): none here."""
    if not distills_tokens(recipe):
        return []
    rows: list[str | None] = [*domain_names(recipe)] or [None]
    routed = {teacher_of(recipe, d) for d in rows}
    return [t.name for t in recipe.distill.teachers if t.name in routed]

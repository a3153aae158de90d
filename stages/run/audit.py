"""`unirl audit RUN`: what a finished or running run's storage says it did, checked for every
committed iteration (`iter-NNNNNN/_SUCCESS`; one still running is not looked at):

1. every rollout group was trained once: no sample twice in an iteration's trained rows, no group
   in two iterations' trained rows, none that is not among the iteration's own requests (with
   partial rollouts: or those of the max_staleness iterations before it), no rollout
   file of another iteration's folder, and in async RL no row the producer did not sample for the
   iteration (`manifests/produce.json`);
2. every trained row's `policy_version` (a partial rollout's: its oldest token's, every token's
   version in `token_versions`) is no newer than the version the trainer held for its
   iteration (the iteration, or with rollout accumulation the windows before it,
   stages/runtime/accumulation.py) and at most as old as the run allows: `rollout.max_staleness`
   in async RL; in sync RL `rollout.engine.sync.every` - 1 on an engine with weights of its own, 0
   where rollout samples with the trained weights; with rollout accumulation, each window's last
   iteration took the update on the window's batches (train.json `window`) and the others took none;
3. every published folder (weights/vN, adapters/vN) matches the sha256 its manifest lists
   (stages/train/manifests.py);
4. the behaviour check held: the first update's largest |replayed - recorded| log-prob
   (`behaviour_logp_max_abs_diff` in train.json) is within the tolerance the run used, or within
   its mask limit with the tokens above the tolerance masked (`behaviour_masked_frac` > 0),
   wherever every trained row (of the update's whole window) was sampled by the weights being
   trained (rows of older versions are only measured, by the trainer as here).

An iteration's trained rows are what its train step read: the rows of the files its committed
generate stages list (`manifests/generate*.json`) that have an advantage (`advantages.arrow`).
The rules come from the recipe stored with the run (recipe.yaml). A pipeline's parts are runs of
their own (`parts/<name>`), each checked over the pipeline's committed iterations.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from unirl.stages.compose import shape_of
from unirl.stages.policies import behaviour_mask_limit, behaviour_tolerance
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.accumulation import accumulated, closes, version_after, version_of, window
from unirl.stages.runtime.registry import engines
from unirl.stages.runtime.sample import ShardSchemaError, read_shard
from unirl.stages.runtime.storage import RunStorage, iter_dir, join
from unirl.stages.runtime.yaml_input import load_yaml
from unirl.stages.sections import StorageConfig
from unirl.stages.train.manifests import mismatches

LIMIT = 5  # problems of one kind listed per iteration; the rest are counted
BEHAVIOUR = "behaviour_logp_max_abs_diff"


class NotARunError(ValueError):
    """The folder given is not a run's."""


@dataclass
class Line:
    """One audited iteration of one run (a pipeline part's: `where` starts with parts/<name>/)."""

    where: str
    groups: int = 0
    rows: int = 0
    versions: tuple[int, int] | None = None
    weights: str = "-"  # ok | BAD | - (nothing published by this iteration)
    behaviour: float | None = None
    measured_only: bool = False  # rows of older versions: the trainer measures, it does not judge
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    run: str
    committed: list[int]
    pending: list[int]
    lines: list[Line] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # of no one iteration (weights v000000, ...)
    weights_checked: int = 0

    @property
    def violations(self) -> list[str]:
        return [p for line in self.lines for p in line.problems] + self.problems

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self) -> str:
        """The table (one line per audited iteration), then every violation."""
        head = f"audit of {self.run}: {len(self.committed)} committed iteration(s)"
        if self.pending:
            head += f"; {', '.join(iter_dir(i) for i in self.pending)} not committed yet (not audited)"
        width = max([len("iteration"), *(len(line.where) for line in self.lines)])
        out = [head, f"{'iteration':<{width}}  {'groups':>6}  {'rows':>6}  {'versions':<9}  {'weights':<7}  "
                     f"{'behaviour max diff':<24}  status"]
        for line in self.lines:
            versions = "-" if line.versions is None else f"{line.versions[0]}..{line.versions[1]}"
            behaviour = "-" if line.behaviour is None else f"{line.behaviour:.3g}" + (" (stale: measured)" if line.measured_only else "")
            status = f"FAIL ({len(line.problems)})" if line.problems else "ok"
            out.append(f"{line.where:<{width}}  {line.groups:>6}  {line.rows:>6}  {versions:<9}  {line.weights:<7}  "
                       f"{behaviour:<24}  {status}")
        out.append(f"published weights folders checked against their manifests: {self.weights_checked}")
        violations = self.violations
        out += ["violations:", *(f"  {v}" for v in violations)] if violations else []
        out.append(f"audit failed: {len(violations)} violation(s)" if violations else "audit passed")
        return "\n".join(out)


def resolve(run: str, root: str | None = None, options: dict[str, Any] | None = None) -> RunStorage:
    """The storage of `run`: a run name under `root` (default: the recipe's default `storage.root`),
    or a run folder's path or URL (runs/tiny, s3://bucket/runs/tiny), its last part the run's name."""
    url = run.rstrip("/")
    if "/" not in url:
        return RunStorage(root or StorageConfig().root, url, options)
    parent, name = url.rsplit("/", 1)
    if root:
        raise NotARunError(f"{run}: a run's folder or URL already says where it is; give --root only with a run name")
    if parent.endswith(":/"):
        raise NotARunError(f"{run}: not a run folder (a bucket or filesystem root); give the run's folder, e.g. "
                           "s3://bucket/runs/tiny")
    return RunStorage(parent or "/", name, options)


def stored_recipe(storage: RunStorage) -> Any:
    """The recipe a run was started with (its recipe.yaml, as `unirl run` wrote it)."""
    where = storage.url("recipe.yaml")
    return build_recipe(load_yaml(storage.read_bytes("recipe.yaml"), where), where)


def audit_run(storage: RunStorage) -> Report:
    """Check every committed iteration of the run in `storage` (module docstring); never changes it."""
    if not (storage.exists("run.json") and storage.exists("recipe.yaml")):
        raise NotARunError(f"{storage.url()}: not a run folder (no run.json and recipe.yaml there); give a run's folder "
                           "or URL (runs/tiny, s3://bucket/runs/tiny), or its name with --root")
    recipe = stored_recipe(storage)
    found = storage.iterations()
    committed = [i for i in found if storage.is_success(i)]
    report = Report(storage.url(), committed, [i for i in found if i not in committed])
    parts = [name for name in storage.listdir("parts") if storage.exists(join("parts", name, "run.json"))]
    RunAudit(storage, recipe, "", report).run(committed, trains_here=not parts)
    for name in parts:  # a pipeline's parts: their own runs, over the pipeline's iterations
        part = RunStorage(storage.url("parts"), name, storage.options)
        RunAudit(part, stored_recipe(part), f"parts/{name}/", report).run(committed, trains_here=False)
    return report


class RunAudit:
    """The checks of one run folder, iteration after iteration (what it trained so far is kept)."""

    def __init__(self, storage: RunStorage, recipe: Any, label: str, report: Report):
        self.storage, self.label, self.report, self.recipe = storage, label, report, recipe
        self.first: dict[str, str] = {}  # group id -> the iteration that trained it first
        self.windows: dict[int, list[int]] = {}  # an accumulation window's first iteration -> its rows' versions
        self.allowed, self.why = staleness(recipe)
        self.tolerances = tolerances(recipe)

    def run(self, committed: list[int], *, trains_here: bool) -> None:
        weights = self.published()
        for i in committed:
            manifests = self.storage.listdir(join(iter_dir(i), "manifests"))
            if "train.json" not in manifests:
                if trains_here:
                    self.report.lines.append(Line(self.where(i), problems=[
                        f"{self.where(i)}: committed (_SUCCESS) without a committed train step (manifests/train.json)"]))
                continue
            try:
                line = self.iteration(i, manifests)
            except (ShardSchemaError, FileNotFoundError) as exc:  # a file its manifests name, missing or broken
                line = Line(self.where(i), problems=[f"{self.where(i)}: cannot be read back: {exc}"])
            rels = weights.pop(version_after(self.recipe, i), None) if closes(self.recipe, i) else None
            if rels is not None:
                bad = [p for rel in rels for p in self.weights_problems(rel)]
                line.weights = "BAD" if bad else "ok"
                line.problems += bad
            self.report.lines.append(line)
        for rels in weights.values():  # v000000, and versions of iterations not committed yet
            for rel in rels:
                self.report.problems += self.weights_problems(rel)

    def where(self, iteration: int) -> str:
        return f"{self.label}{iter_dir(iteration)}"

    # -- 1 and 2: the trained rows ------------------------------------------------------------------
    def iteration(self, i: int, manifests: list[str]) -> Line:
        where = self.where(i)
        found: dict[str, list[str]] = {}

        def problem(kind: str, text: str) -> None:
            found.setdefault(kind, []).append(f"{where}: {text}")

        newest: dict[str, int] = {}
        rows = self.trained_rows(i, manifests, problem, newest)
        self.once(i, manifests, rows, problem)
        trained = version_of(self.recipe, i)  # i itself without rollout accumulation
        for sid, (_, version, _) in rows.items():
            if sid in newest and newest[sid] > trained:
                problem("version", f"row {sid!r} has tokens of policy version {newest[sid]}, newer than the iteration "
                                   f"(version {trained})")
            elif version > trained:
                problem("version", f"row {sid!r} policy_version {version} is newer than the iteration (version {trained})")
            elif trained - version > self.allowed:
                problem("version", f"row {sid!r} policy_version {version} is {trained - version} older than the iteration "
                                   f"({self.why})")
        versions = [v for _, v, _ in rows.values()]
        line = Line(where, groups=len({g for g, _, _ in rows.values()}), rows=len(rows),
                    versions=(min(versions), max(versions)) if versions else None)
        seen = self.windows.setdefault(window(self.recipe, i)[0], [])
        seen += versions
        self.accumulation(i, problem)
        self.behaviour(i, line, fresh=all(v == trained for v in seen), problem=problem)
        for texts in found.values():
            line.problems += texts[:LIMIT]
            if len(texts) > LIMIT:
                line.problems.append(f"{where}: ... and {len(texts) - LIMIT} more like the one before")
        return line

    def trained_rows(self, i: int, manifests: list[str], problem: Any,
                     newest: dict[str, int]) -> dict[str, tuple[str, int, str]]:
        """Sample id -> (group id, policy version, file) of what iteration i's train step read: the
        rows of its generate stages' files that have an advantage (the others were dropped: dynamic
        sampling, the staleness bound). A row read twice, or a file of another iteration, is a problem.
        A partial rollout's row (`token_versions`) counts its oldest token's version, which its
        policy_version must be; `newest` gets its newest token's."""
        d = iter_dir(i)
        advantaged = set(self.column(self.manifest(i, "advantage.json")["files"][0], "advantages", "sample_id"))
        rows: dict[str, tuple[str, int, str]] = {}
        for rel in self.generated(i, manifests):
            if not rel.startswith(d + "/"):
                problem("file", f"trains {rel}, a rollout file of another iteration's folder")
            table = read_shard(self.storage, rel, "rollouts")
            tokens = table.column("token_versions").to_pylist() if "token_versions" in table.schema.names else None
            table = table.select(["sample_id", "group_id", "policy_version"])
            for n, (sid, gid, version) in enumerate(zip(*(table.column(c).to_pylist() for c in table.schema.names))):
                if sid not in advantaged:
                    continue
                if sid in rows:
                    problem("twice", f"row {sid!r} trained twice ({rows[sid][2]} and {rel})")
                    continue
                if tokens is not None and tokens[n]:
                    oldest, newest[sid] = min(tokens[n]), max(tokens[n])
                    if version != oldest:
                        problem("tokens", f"row {sid!r} policy_version {version} is not its oldest token's version {oldest}")
                        version = oldest
                rows[sid] = (gid, version, rel)
        return rows

    def once(self, i: int, manifests: list[str], rows: dict[str, tuple[str, int, str]], problem: Any) -> None:
        """Each group of iteration i's trained rows trained by no earlier iteration, among its own
        requests, and (async RL) each row sampled for it by the producer."""
        d = iter_dir(i)
        requested = self.requested(i, manifests)
        for gid in dict.fromkeys(gid for gid, _, _ in rows.values()):
            if gid in self.first:
                problem("again", f"group {gid!r} trained again (first in {self.first[gid]})")
                continue
            if requested is not None and gid not in requested:
                problem("request", f"group {gid!r} trained, but it is not among {d}'s requests")
            self.first[gid] = self.where(i)
        if "produce.json" not in manifests:
            return
        produced_files = self.manifest(i, "produce.json")["files"]
        if sorted(produced_files) != sorted(self.generated(i, manifests)):  # the trainer admitted part of the batch
            produced = {s for rel in produced_files for s in self.column(rel, "rollouts", "sample_id")}
            for sid, (_, _, rel) in rows.items():
                if sid not in produced:
                    problem("produce", f"row {sid!r} ({rel}) was not sampled by the producer for {d}")

    def generated(self, i: int, manifests: list[str]) -> list[str]:
        """The rollout files of iteration i's generate stages (refill rounds, a unified model's stages)."""
        return [f for m in manifests if m.startswith("generate") and m.endswith(".json") for f in self.manifest(i, m)["files"]]

    def requested(self, i: int, manifests: list[str]) -> set[str] | None:
        """The group ids of the iteration's committed requests (None: it has none to compare with);
        with partial rollouts also those of the iterations before it whose cut groups it may finish
        (its oldest token within max_staleness of the iteration that trains it)."""
        files = [f for m in manifests if m.startswith("requests") and m.endswith(".json") for f in self.manifest(i, m)["files"]]
        if not files:
            return None
        if getattr(self.recipe.rollout, "partial", None) is not None:
            for j in range(max(0, i - self.recipe.rollout.max_staleness), i):
                earlier = join(iter_dir(j), "manifests", "requests.json")
                files += self.storage.read_json(earlier)["files"] if self.storage.exists(earlier) else []
        return {g for rel in files for g in self.column(rel, "requests", "group_id")}

    def accumulation(self, i: int, problem: Any) -> None:
        """With rollout accumulation: the update at the window's last iteration, on the whole
        window (train.json `window`), and none before it."""
        if accumulated(self.recipe) == 1:
            return
        trained = self.train_record(i)
        span = window(self.recipe, i)
        if trained.get("window") != [span[0], span[-1]]:
            problem("window", f"train.json names the window {trained.get('window')}, not {[span[0], span[-1]]} "
                              f"(train.accumulate_rollouts {accumulated(self.recipe)})")
        if bool(trained.get("update")) != closes(self.recipe, i):
            said = "took an update" if trained.get("update") else "took no update"
            problem("window", f"{said}, but the update of {iter_dir(span[0])} .. {iter_dir(span[-1])} is its last "
                              "iteration's")

    def train_record(self, i: int) -> dict[str, Any]:
        rel = join(iter_dir(i), "train.json")
        return self.storage.read_json(rel) if self.storage.exists(rel) else self.manifest(i, "train.json")

    # -- 4: the behaviour check -------------------------------------------------------------------------
    def behaviour(self, i: int, line: Line, *, fresh: bool, problem: Any) -> None:
        rel = join(iter_dir(i), "train.json")
        metrics = self.train_record(i).get("metrics", {})
        for key, value in sorted(metrics.items()):
            if key != BEHAVIOUR and not key.endswith("/" + BEHAVIOUR):
                continue
            stage = key[: -len(BEHAVIOUR) - 1] if key != BEHAVIOUR else ""
            value = float(value)
            line.behaviour = value if line.behaviour is None else max(line.behaviour, value)
            line.measured_only = not fresh
            if not fresh or stage not in self.tolerances:
                continue
            tolerance, limit = self.tolerances[stage]
            if value <= tolerance:
                continue
            what = f"stage {stage!r}: " if stage else ""
            masked = float(metrics.get(key.replace(BEHAVIOUR, "behaviour_masked_frac"), 0.0))
            if not value <= limit:  # also catches nan
                problem("behaviour", f"{what}the first update's replay differs from the log-probs recorded at sampling by "
                                     f"{value:.3g}, above the run's tolerance {tolerance:.3g}"
                                     + (f" and mask limit {limit:.3g}" if limit > tolerance else "") + f" ({rel} {key})")
            elif not masked > 0:
                problem("behaviour", f"{what}the first update's replay differs from the log-probs recorded at sampling by "
                                     f"{value:.3g}, above the run's tolerance {tolerance:.3g}, and no token was masked "
                                     f"({rel} {key})")

    # -- 3: the published weights -----------------------------------------------------------------------
    def published(self) -> dict[int, list[str]]:
        """Version -> its published folders (weights/vN, adapters/vN)."""
        out: dict[int, list[str]] = {}
        for v in self.storage.weights_versions():
            out.setdefault(v, []).append(self.storage.weights_rel(v))
        for v in self.storage.adapter_versions():
            out.setdefault(v, []).append(self.storage.adapters_rel(v))
        return out

    def weights_problems(self, rel: str) -> list[str]:
        self.report.weights_checked += 1
        said = {"missing": "listed in its manifest, but missing", "sha256": "sha256 differs from its manifest"}
        return [f"{self.label}{posixpath.join(rel, name)}: {said[what]}" for name, what in mismatches(self.storage, rel)]

    # -- reading ------------------------------------------------------------------------------------------
    def manifest(self, i: int, name: str) -> dict[str, Any]:
        return self.storage.read_json(join(iter_dir(i), "manifests", name))

    def column(self, rel: str, kind: str, name: str) -> list[Any]:
        return read_shard(self.storage, rel, kind).column(name).to_pylist()


def staleness(recipe: Any) -> tuple[int, str]:
    """How many versions older than its iteration a trained row may be, and the setting that says so."""
    r = recipe.rollout
    if r.mode == "async":
        return r.max_staleness, f"max_staleness {r.max_staleness}"
    if engines.get(r.engine.name).own_weights:
        every = r.engine.sync.every
        return every - 1, f"rollout.engine.sync.every {every}"
    return 0, "sync rollout with the trained weights"


def tolerances(recipe: Any) -> dict[str, tuple[float, float]]:
    """The behaviour tolerance and mask limit (the tolerance where there is no mask band) of each
    policy the run trains, by the prefix of its train metrics ("": a single model's; a unified
    model's stages by name)."""
    def levels(part: Any) -> tuple[float, float]:
        tolerance, limit = behaviour_tolerance(part), behaviour_mask_limit(part)
        return tolerance, tolerance if limit is None else limit  # never below the tolerance

    shape = shape_of(recipe)
    grouped = shape.group_stages(recipe) if shape is not None else None
    if grouped is None:
        return {"": levels(recipe)}
    return {name: levels(part) for name, (part, _) in grouped.items()}

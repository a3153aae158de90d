"""A quickstart (SFT then RL) for several seeds: wall time and the held-out score after SFT and
after RL, per seed, read from the run's own evaluations of the test split
(`eval/<version>/test/metrics.json`; `--split dev` reads the dev split, `eval/<version>/metrics.json`,
which recipes are tuned on). A seed changes the model initialisation, the SFT example order and
the sampling; the held-out prompts stay fixed.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2                      # AR: exact match
    python benchmarks/quickstart_seeds.py --recipe recipes/diffusion/quickstart.yaml   # toy-GenEval strict
    python benchmarks/quickstart_seeds.py --recipe recipes/video/quickstart.yaml --components  # + per-component means
    python benchmarks/quickstart_seeds.py --recipe recipes/pe/quickstart.yaml        # the pipeline: image strict score
    python benchmarks/quickstart_seeds.py --recipe recipes/distill/quickstart.yaml   # + per domain, beside its teacher
    python benchmarks/quickstart_seeds.py --recipe recipes/distill/flow.yaml --teacher recipes/distill/flow_teacher.yaml
                                      # per seed: the teacher's run (its own rows), then the student distilled from it

`acc` is the greedy score (AR: greedy decoding; diffusion: the deterministic ODE sampler),
`avg@k` the mean over k sampled answers or images per prompt; `CPU s` the user + system seconds
of the run and everything it started (on a shared machine the wall time is inflated by the
others' load, the CPU time much less). Each run's console goes to `<work>/seed<N>.log` as it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def components(recipe_path: str, overrides: list[str], work: Path, name: str, version: str, split: str) -> dict[str, float]:
    """The eval scorer's per-component means over one evaluation's greedy and sampled outputs
    (`greedy/<component>`, `sampled/<component>`): which part of the prompt a model gets wrong."""
    import numpy as np

    from unirl.stages.recipe import load_recipe
    from unirl.stages.rewards.base import build_scorer, run_scorer
    from unirl.stages.run.iteration import SCORED_COLUMNS, reads, score_batch
    from unirl.stages.runtime.sample import read_rollouts, scoring_view
    from unirl.stages.runtime.storage import RunStorage

    recipe = load_recipe(recipe_path, overrides, local_files=False)  # its domains and routing; the run read the folders
    scorer_name, params = recipe.eval_scorer()
    storage = RunStorage(str(work), name)
    out = {}
    for kind in ("greedy", "sampled"):
        folder = work / name / "eval" / version / ("test" if split == "test" else "") / kind
        files = sorted(p.relative_to(work / name).as_posix() for p in folder.rglob("*.arrow"))
        table = scoring_view(read_rollouts(storage, files, columns=SCORED_COLUMNS))
        result = run_scorer(build_scorer(scorer_name, **params), score_batch(
            table, prompt_images=reads([scorer_name], "image"), transcripts=reads([scorer_name], "transcript")))
        out.update({f"{kind}/{k}": float(np.mean(v)) for k, v in sorted((result.components or {}).items())})
    return out


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process (the run, its Prefect server and
    worker ranks): on a shared machine wall time grows with the others' load, CPU time does not."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def seed_overrides(recipe_path: str, seed: int) -> list[str]:
    """The overrides that make `seed` a different run: the run's seed and each model's tiny
    initialisation and warm-start order (a pipeline's every part)."""
    import yaml

    raw = yaml.safe_load(Path(recipe_path).read_text()) or {}
    compose = raw.get("compose") or {}
    parts = compose.get("parts") if compose.get("kind") == "pipeline" else None
    sections = [(f"compose.parts.{i}.", part) for i, part in enumerate(parts)] if parts else [("", raw)]
    keys = []
    for prefix, part in sections:
        if not (part.get("model") or {}).get("path"):  # a model loaded from a folder has no initialisation to seed
            keys.append(f"{prefix}model.tiny.seed={seed}")
        if part.get("sft") is not None:
            keys.append(f"{prefix}sft.seed={seed}")
    teachers = [f"distill.teachers.{i}.sft.seed={seed}" for i, t in enumerate((raw.get("distill") or {}).get("teachers") or [])
                if t.get("sft") is not None]  # teachers trained at the start: their example order too
    return [f"seed={seed}", *keys, *teachers]


def domain_line(recipe_path: str, overrides: list[str], work: Path, name: str, split: str, before: dict[str, float],
                after: dict[str, float]) -> str:
    """A mixture's greedy accuracy per domain before -> after, and beside it the domain's teacher's
    (trained at the run's start, evaluated on the same split) and the student's share of it."""
    from unirl.stages.distill import domain_names, teacher_of, teacher_run
    from unirl.stages.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides, local_files=False)  # its domains and routing; the run read the folders
    p, sub = ("test", "test") if split == "test" else ("eval", "")
    out = []
    for d in domain_names(recipe):
        text = f"{d} {before[f'{p}/{d}/accuracy']:.3f} -> {after[f'{p}/{d}/accuracy']:.3f}"
        teacher = teacher_of(recipe, d)
        found = work / teacher_run(name, teacher) / "eval" / "v000000" / sub / "metrics.json" if teacher else None
        if found is not None and found.exists():
            theirs = json.loads(found.read_text())["metrics"][f"{p}/accuracy"]
            share = f" = {after[f'{p}/{d}/accuracy'] / theirs:.0%}" if theirs else ""
            text += f" (teacher {teacher} {theirs:.3f}{share})"
        out.append(text)
    return "  " + ", ".join(out) if out else ""


def run(recipe: str, name: str, overrides: list[str], work: Path, env: dict[str, str]) -> tuple[float, float]:
    """One run of `recipe` as `<work>/<name>`, its console in `<work>/<name>.log`: wall and CPU seconds."""
    cmd = [sys.executable, "-m", "unirl.flows.cli", "run", recipe, f"storage.root={work}", "--run-name", name, *overrides]
    start, cpu_start = time.perf_counter(), _children_cpu()
    log = work / f"{name}.log"
    with log.open("w") as console:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(log.read_text()[-4000:])
    return time.perf_counter() - start, _children_cpu() - cpu_start


def evaluations(work: Path, name: str, split: str) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """A run's evaluated versions of `split` and the metrics of its first and last."""
    sub = "test" if split == "test" else ""
    versions = sorted(v.name for v in (work / name / "eval").iterdir() if (v / sub / "metrics.json").exists())
    first, last = (json.loads((work / name / "eval" / v / sub / "metrics.json").read_text())["metrics"]
                   for v in (versions[0], versions[-1]))
    return versions, first, last


def taught_by(work: Path, teacher_run: str) -> list[str]:
    """The overrides that make a distillation start from `teacher_run`'s warm start (its first
    published weights) and learn from its last, as the run's storage lists them."""
    from unirl.stages.runtime.storage import RunStorage

    storage = RunStorage(str(work), teacher_run)
    first, *_, last = storage.weights_versions()
    folder = work / teacher_run
    return [f"model.path={folder / storage.weights_rel(first)}", f"distill.teachers.0.path={folder / storage.weights_rel(last)}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default=str(REPO / "recipes/ar/quickstart.yaml"))
    parser.add_argument("--components", action="store_true",
                        help="also print the eval scorer's per-component means after SFT and after RL")
    parser.add_argument("--split", choices=("test", "dev", "both"), default="test",
                        help="the held-out split to report (test: what tables report; dev: what recipes are tuned on; "
                        "both: a row for each, from the same runs)")
    parser.add_argument("--teacher", metavar="RECIPE",
                        help="a distillation from another run: per seed, RECIPE runs first (as `teacher<seed>`, with the "
                        "seed's overrides), then the recipe starts from its warm start (model.path = its weights/v000000) "
                        "and is taught by its last weights (distill.teachers.0.path); the teacher's rows are printed too")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unirl-seeds-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    print(f"runs and their console logs: {work}", flush=True)
    splits = ("dev", "test") if args.split == "both" else (args.split,)
    header = False

    def report(seed: int, run_name: str, recipe: str, overrides: list[str], wall: float, cpu: float, label: str = "") -> None:
        """One row per split as soon as its run is done: a long sweep shows its results as it goes."""
        nonlocal header
        for split in splits:
            p = "test" if split == "test" else "eval"
            versions, before, after = evaluations(work, run_name, split)
            k = next(key for key in before if key.startswith(f"{p}/avg_at_")).rsplit("_", 1)[1]
            if not header:
                header = True
                print(f"{'split':>5s} {'seed':>4s} {'wall s':>7s} {'CPU s':>6s} {'acc SFT':>8s} {'acc RL':>7s} {'gain':>6s} "
                      f"{f'avg@{k} SFT':>10s} {f'avg@{k} RL':>9s} {'gain':>6s}")
            gain = after[f"{p}/accuracy"] - before[f"{p}/accuracy"]
            avg_gain = after[f"{p}/avg_at_{k}"] - before[f"{p}/avg_at_{k}"]
            agent = (f"  turns {before[f'{p}/turns_mean']:.2f} -> {after[f'{p}/turns_mean']:.2f}  tool ok "
                     f"{before[f'{p}/tool_success']:.2f} -> {after[f'{p}/tool_success']:.2f}"
                     if f"{p}/turns_mean" in before else "")  # an agentic run's tool use, before and after RL
            print(f"{split:>5s} {seed:>4d} {wall:7.0f} {cpu:6.0f} {before[f'{p}/accuracy']:8.3f} {after[f'{p}/accuracy']:7.3f} "
                  f"{gain:+6.3f} {before[f'{p}/avg_at_{k}']:10.3f} {after[f'{p}/avg_at_{k}']:9.3f} {avg_gain:+6.3f}{agent}"
                  f"{domain_line(recipe, overrides, work, run_name, split, before, after)}{label}", flush=True)
            if args.components:
                common = [f"seed={seed}", *overrides]
                for what, version in (("SFT", versions[0]), ("RL", versions[-1])):
                    parts = components(recipe, common, work, run_name, version, split)
                    print(f"{split} seed {seed} {what} components: " + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()),
                          flush=True)

    for seed in args.seeds:
        overrides = [*seed_overrides(args.recipe, seed), *args.overrides]
        if args.teacher:
            teacher, theirs = f"teacher{seed}", seed_overrides(args.teacher, seed)
            report(seed, teacher, args.teacher, theirs, *run(args.teacher, teacher, theirs, work, env), "  (the teacher's run)")
            overrides += taught_by(work, teacher)
        name = f"seed{seed}"
        report(seed, name, args.recipe, overrides, *run(args.recipe, name, overrides, work, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())

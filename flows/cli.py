"""`unirl`: run and validate recipes, serve rewards.

    unirl run RECIPE [key.sub=value ...] [--run-name NAME] [--resume] [--verbose]
    unirl validate RECIPE [key.sub=value ...] [--memory [--prompt-tokens N]]
    unirl sft RECIPE [key.sub=value ...] [--run-name NAME]
    unirl evaluate RECIPE [key.sub=value ...] [--run-name NAME] [--version N] [--split dev|test]
    unirl agent RECIPE [key.sub=value ...] [--run-name NAME] [--group ID]   (one node of a multi-node run)
    unirl reward-server --config FILE
    unirl engine-server RECIPE [key.sub=value ...] [--weights DIR] [--port N]
    unirl audit RUN [--root ROOT]          (RUN: a run name under ROOT, or a run folder's path or URL)
    unirl ui [STORE] [--port N]            (MLflow's UI over a storage root's runs; STORE default: runs)
"""
from __future__ import annotations

import argparse
import sys

from unirl.stages.runtime import startup

startup.importing()  # until the command's imports are done (stages/runtime/startup.py)

from unirl.stages.recipe import RecipeError, load_recipe  # noqa: E402

# What every run, SFT and evaluation imports once it has started (stages/run/tracking.py), imported
# with the collector still off.
RUN_IMPORTS = ("mlflow.tracking",)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for every model family, on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a recipe as a Prefect flow")
    run.add_argument("recipe", help="recipe YAML file")
    run.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    run.add_argument("--run-name", default="", help="run folder name (default: the recipe's name); the same name "
                     "resumes a run that did not finish")
    run.add_argument("--resume", action="store_true", help="start a finished run again to report it (its held-out "
                     "lines, anything MLflow misses) instead of failing with 'run X is finished'")
    run.add_argument("--verbose", action="store_true", help="Prefect's flow and task run logs on the console too")
    sft = sub.add_parser("sft", help="run only the supervised warm start of a recipe (its `sft` section)")
    sft.add_argument("recipe", help="recipe YAML file")
    sft.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    sft.add_argument("--run-name", default="", help="run folder name (default: the recipe's name)")
    sft.add_argument("--verbose", action="store_true", help="Prefect's flow and task run logs on the console too")
    ev = sub.add_parser("evaluate", help="held-out accuracy of a run's policy")
    ev.add_argument("recipe", help="recipe YAML file")
    ev.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ev.add_argument("--run-name", default="", help="run folder name (default: the recipe's name)")
    ev.add_argument("--version", type=int, default=None, help="policy version (default: the last finished)")
    ev.add_argument("--split", choices=("dev", "test"), default="dev",
                    help="held-out split: dev (what recipes are tuned on) or test (report it once, after tuning)")
    ev.add_argument("--verbose", action="store_true", help="Prefect's flow and task run logs on the console too")
    agent = sub.add_parser("agent", help="run this node's torchrun agent for a multi-node run (train.nnodes > 1)")
    agent.add_argument("recipe", help="the run's recipe YAML file")
    agent.add_argument("overrides", nargs="*", help="key.sub=value overrides (the run's)")
    agent.add_argument("--run-name", default="", help="the run's folder name (default: the recipe's name)")
    agent.add_argument("--group", default="", help="the group to join (default: the run's newest, waiting for one)")
    val = sub.add_parser("validate", help="print the resolved recipe or every error, without loading a model")
    val.add_argument("recipe", help="recipe YAML file")
    val.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    val.add_argument("--memory", action="store_true", help="each rank's peak memory, term by term, instead of the recipe "
                     "(qwen3, Qwen-VL and sd3 models; docs/scaling.md)")
    val.add_argument("--prompt-tokens", type=int, default=256, help="prompt length the --memory estimate assumes (default 256)")
    rs = sub.add_parser("reward-server", help="serve scorers over HTTP", add_help=False)
    rs.add_argument("rest", nargs=argparse.REMAINDER)
    au = sub.add_parser("audit", help="check a run's storage: each group trained once, staleness, weights, behaviour")
    au.add_argument("run", help="run name (under --root), or a run folder's path or URL (runs/tiny, s3://bucket/runs/tiny)")
    au.add_argument("--root", default=None, help="storage root of a run name (default: storage.root's default, runs)")
    ui = sub.add_parser("ui", help="serve MLflow's UI over a storage root's store: every run of it in one place")
    ui.add_argument("store", nargs="?", default="runs",
                    help="a storage root (its mlflow.db), a .db file, or a tracking URI (default: runs)")
    ui.add_argument("--port", type=int, default=None, help="port (default: 5000 when free, else a free one)")
    es = sub.add_parser("engine-server", help="serve a recipe's policy as a rollout engine (docs/engines.md)", add_help=False)
    es.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reward-server"]:
        from unirl.flows.reward_server import main as serve  # start-up time: loaded on first use

        startup.imports_done()
        return serve(argv[1:])
    if argv[:1] == ["engine-server"]:
        from unirl.stages.engine_server import main as engine_server  # start-up time: loaded on first use

        startup.imports_done()
        return engine_server(argv[1:])
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("audit", "ui"):
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        startup.imports_done()
        if args.command == "ui":
            from unirl.flows.ui import serve as serve_ui  # start-up time: loaded on first use

            return serve_ui(args.store, args.port)
        return audit(args.run, args.root)
    # overrides may also follow options (`--run-name x train.lr=0.1`)
    stray = [a for a in rest if a.startswith("-") or "=" not in a]
    if stray or not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(stray or rest)}")
    args.overrides = list(args.overrides) + rest
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "validate":
        if not args.memory:
            print(recipe.to_yaml(), end="")
            return 0
        from unirl.stages.run.memory import estimate, memory_table  # start-up time: it loads torch to measure a layer

        try:
            print(memory_table(estimate(recipe, max(1, args.prompt_tokens))))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.run_name:
        from unirl.stages.recipe import check_run_name  # start-up time: loaded on first use

        try:
            check_run_name(args.run_name, "--run-name")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    import signal  # start-up time: loaded on first use

    from unirl.stages.runtime.storage import interrupt  # start-up time: loaded on first use

    # Ctrl-C, and SIGTERM (Prefect cancellation, Kubernetes, `kill`), stop the run the same way:
    # every thread's object-store retries end, and the main thread is interrupted.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    if args.command == "agent":  # no Prefect here: the flow runs elsewhere
        startup.imports_done()
        return node_agent(recipe, args.run_name or recipe.name, args.group)
    if args.command in ("run", "sft"):
        from unirl.stages.run.record import check_inputs  # start-up time: loaded on first use

        try:
            check_inputs(recipe)  # a bad model folder or data file, before Prefect, MLflow or a model start
        except (OSError, ValueError) as exc:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    from unirl.tasks.console import error_text, failures_once, quiet_prefect, say  # start-up time: loaded on first use

    quiet_prefect(args.verbose)  # before Prefect configures its logging
    run_name = args.run_name or recipe.name
    try:
        if args.command == "run" and not args.resume:
            from unirl.stages.run.record import finished_error  # start-up time: loaded on first use

            if (finished := finished_error(recipe, run_name)) is not None:  # before Prefect starts: nothing to do
                print(f"error: {finished}", file=sys.stderr)
                return 1
        from unirl.flows.ephemeral import LocalApiDown, local_api  # start-up time: loaded on first use

        failures_once(args.verbose)
        with local_api(lambda: api_folder(recipe, run_name), log=say) as api:
            if args.command == "sft":
                from unirl.flows.sft import sft  # start-up time: loaded on first use

                startup.imports_done(*RUN_IMPORTS)
                sft(recipe, run_name)
                return 0
            if args.command == "evaluate":
                from unirl.flows.evaluate import evaluate_run  # start-up time: it loads torch

                startup.imports_done(*RUN_IMPORTS)
                evaluate_run(recipe, run_name, args.version, args.split)
                return 0
            from unirl.flows.rl import rl_train  # start-up time: it loads torch

            startup.imports_done(*RUN_IMPORTS)
            while True:
                restarts = api.restarts if api is not None else 0
                try:
                    result = rl_train(recipe, run_name, resume=args.resume)
                    break
                except Exception as exc:
                    # A run that failed while its local API server died and was started again goes on
                    # from its last commit (bounded: the server is started again a few times at most).
                    if api is not None and api.gave_up:
                        raise LocalApiDown(f"Prefect's local API server kept dying (its log: {api.log_path}); nothing "
                                           "committed is lost: run the same command again to resume") from exc
                    if api is None or api.restarts == restarts:
                        raise
                    say("[unirl] the run failed while Prefect's local API server was down; resuming from its last commit")
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line for the user; Prefect logged the trace
        print(f"error: {error_text(exc)}", file=sys.stderr)
        return 1
    print(f"[unirl] done: {result['iterations']} iterations in {result['storage']}", flush=True)
    return 0


def api_folder(recipe, run_name: str):
    """Where the local Prefect API of a command keeps its database and log: `<run>/prefect/` for a
    local storage root; a scratch folder, removed at exit, for an object store."""
    from unirl.stages.runtime.scratch import scratch_dir  # start-up time: loaded on first use
    from unirl.stages.runtime.storage import RunStorage

    local = RunStorage(recipe.storage.root, run_name, recipe.storage.options).local_path("prefect")
    return local if local is not None else scratch_dir("unirl-prefect-api-")


def audit(run: str, root: str | None) -> int:
    """`unirl audit`: the table of a run's committed iterations and every violation (exit 1 on any),
    or exit 2 when RUN is not a run (stages/run/audit.py)."""
    from unirl.stages.run.audit import audit_run, resolve  # start-up time: loaded on first use

    try:
        report = audit_run(resolve(run, root))
    except ValueError as exc:  # not a run folder, not a run name, a stored recipe that does not validate
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.text(), flush=True)
    return 0 if report.ok else 1


def node_agent(recipe, run_name: str, group: str) -> int:
    from unirl.stages.runtime.storage import RunStorage  # start-up time: loaded on first use
    from unirl.stages.workers.agent import serve_node
    from unirl.stages.workers.rendezvous import NodeSetupError

    try:
        return serve_node(RunStorage(recipe.storage.root, run_name, recipe.storage.options), recipe, group=group,
                          log=lambda line: print(line, flush=True))
    except NodeSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`unirl`: run and validate recipes, serve rewards.

    unirl run RECIPE [key.sub=value ...] [--run-name NAME]
    unirl validate RECIPE [key.sub=value ...]
    unirl reward-server --config FILE
"""
from __future__ import annotations

import argparse
import sys

from stages.recipe import RecipeError, load_recipe


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for every model family, on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a recipe as a Prefect flow")
    run.add_argument("recipe", help="recipe YAML file")
    run.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    run.add_argument("--run-name", default="", help="run folder name (default: the recipe's name); same name resumes")
    val = sub.add_parser("validate", help="print the resolved recipe or every error, without loading a model")
    val.add_argument("recipe", help="recipe YAML file")
    val.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    rs = sub.add_parser("reward-server", help="serve scorers over HTTP", add_help=False)
    rs.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reward-server"]:
        from flows.reward_server import main as serve

        return serve(argv[1:])
    args = _parser().parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(recipe.to_yaml(), end="")
        return 0
    from flows.rl import rl_train

    try:
        result = rl_train(recipe, args.run_name or recipe.name)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line for the user; Prefect logged the trace
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"[unirl] done: {result['iterations']} iterations in {result['storage']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

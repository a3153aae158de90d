"""`unirl reward-server --config FILE`: serve the configured scorers over HTTP until stopped.

Also runnable as `python -m unirl.flows.reward_server --config FILE`. The config format and the HTTP
contract are in docs/rewards.md; the server itself is stages/rewards/server.py.
"""
from __future__ import annotations

import argparse
import logging
import sys

from unirl.stages.rewards.server import ConfigError, load_config, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="unirl reward-server",
        description="Serve reward scorers over authenticated HTTP (POST /v1/score, GET /healthz).",
    )
    parser.add_argument("--config", required=True, help="YAML or JSON server config")
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    parser.add_argument("--insecure", action="store_true",
                        help="allow `auth: false` on a non-loopback host (anyone who reaches it may score; logged as a warning)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, host=args.host, port=args.port, insecure=True if args.insecure else None)
        logging.basicConfig(
            level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        serve(config)
    except ConfigError as exc:
        print(f"unirl reward-server: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

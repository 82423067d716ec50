"""Serve reward functions over HTTP (the protocol of the `remote` reward) for local tests or as a template."""

from __future__ import annotations

import argparse
import os

from vlrft.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--functions", default="accuracy",
        help="comma-separated reward functions with optional weights, e.g. 'accuracy,format=0.1,my_rewards.py:fn'",
    )
    parser.add_argument("--config", default=None, help="YAML config whose 'reward' section to serve (instead of --functions)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per-function timeout (default: the config's, 30)")
    parser.add_argument("--on-error", choices=["raise", "none"], default=None, help="'none' counts failures as not applicable")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="require 'Authorization: Bearer <key>' with the key read from this environment variable")
    parser.add_argument("--max-request-mb", type=int, default=256, help="largest accepted request body")


def parse_functions(text: str) -> list:
    """'accuracy,format=0.1' -> RewardFunctionConfig list (a trailing '=number' is the weight)."""
    from vlrft.config import RewardFunctionConfig

    functions = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, weight = item, 1.0
        if "=" in item:
            name, _, raw = item.rpartition("=")
            try:
                weight = float(raw)
            except ValueError:
                raise UserError(f"reward-server: --functions item {item!r} has weight {raw!r}, not a number; write name=0.5") from None
        functions.append(RewardFunctionConfig(name=name.strip(), weight=weight))
    if not functions:
        raise UserError("reward-server: --functions is empty; name at least one reward function, e.g. --functions accuracy")
    return functions


def run(args: argparse.Namespace) -> int:
    import logging

    from vlrft.config import RewardConfig, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from vlrft.rewards import RewardSet
    from vlrft.rewards.server import serve

    cfg = load_config(args.config, validate=False).reward if args.config else RewardConfig(functions=parse_functions(args.functions))
    if args.timeout_s is not None:
        cfg.timeout_s = args.timeout_s
    if args.on_error is not None:
        cfg.on_error = args.on_error
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise UserError(f"reward-server: --api-key-env {args.api_key_env} is set but that environment variable is empty or missing")
    rewards = RewardSet.from_config(cfg)
    rewards.prepare()  # a reward model loads before the server answers, not inside the first request's timeout
    serve(rewards, args.host, args.port, api_key, args.max_request_mb)
    return 0

"""Load a config file, apply `section.key=value` overrides, validate it and print the resolved YAML."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 rollout.n=8")
    parser.add_argument("--world-size", type=int, default=None, help="check divisibility for this many ranks")


def run(args: argparse.Namespace) -> int:
    import yaml

    from vlrft.config import load_config, to_dict

    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    print(yaml.safe_dump(to_dict(cfg, redact_secrets=True), sort_keys=False), end="")
    return 0

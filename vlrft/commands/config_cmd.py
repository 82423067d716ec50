"""Load a config file, apply `section.key=value` overrides, validate it and print the resolved YAML.

`--explain KEY` prints what a key (or every key of a section) means, its type and default;
`--markdown` prints the reference of every key (docs/config.md).
"""

import argparse

from vlrft.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 rollout.n=8")
    parser.add_argument("--world-size", type=int, default=None, help="check divisibility for this many ranks")
    parser.add_argument("--explain", metavar="KEY", default=None,
                        help="print what KEY means (e.g. rollout.n, or a section such as algorithm), its type and "
                             "default; with a config file also its value there")
    parser.add_argument("--markdown", action="store_true", help="print the reference of every key as Markdown")


def run(args: argparse.Namespace) -> int:
    import yaml

    from vlrft.config import load_config, to_dict

    if args.markdown:
        from vlrft.config_help import markdown

        print(markdown(), end="")
        return 0
    if args.config is None and args.explain is None:
        raise UserError("give a config file (e.g. vlrft config configs/demo.yaml), --explain KEY or --markdown")
    cfg = None if args.config is None else load_config(args.config, args.overrides, world_size=args.world_size)
    if args.explain is not None:
        from vlrft.config_help import explain

        print(explain(args.explain, cfg))
        return 0
    print(yaml.safe_dump(to_dict(cfg, redact_secrets=True), sort_keys=False), end="")
    return 0

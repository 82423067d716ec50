"""The `vlrft` command. Works the same as `vlrft ...`, `python -m vlrft ...` and under `torchrun`.

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args) -> int`; the
module is imported to build its parser, so keep heavy imports inside `run`. User errors
(`vlrft.errors.UserError`) print as one line and exit 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vlrft.errors import UserError

# name -> (module, one-line help). Order is the order `vlrft --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("vlrft.commands.train_cmd", "train a policy with RL from a YAML config (also under torchrun)"),
    "eval": ("vlrft.commands.eval_cmd", "evaluate a model on the config's eval set"),
    "config": ("vlrft.commands.config_cmd", "load, validate and print a config with overrides applied"),
    "generate": ("vlrft.commands.generate_cmd", "answer one prompt (with optional images) with a model folder"),
    "export": ("vlrft.commands.export_cmd", "merge a LoRA checkpoint into its base model (a full Hugging Face folder)"),
    "plan": ("vlrft.commands.plan_cmd", "per-GPU memory of a config by component, and whether it fits (exit 0/1)"),
    "env": ("vlrft.commands.env_cmd", "print this machine's stack (torch, GPUs, engines) and what in it does not fit"),
    "tiny": ("vlrft.commands.tiny_cmd", "build a tiny random-weight VLM (Qwen-VL, Qwen3-VL-MoE, GLM-4.1V, Gemma 3, InternVL 3, LLaVA-OneVision, SmolVLM) + processor folder (tests, demo)"),
    "data": ("vlrft.commands.data_cmd", "check, convert or generate datasets (data check|convert|synth)"),
    "serve-command": ("vlrft.commands.serve_command_cmd", "print the command that starts a vLLM rollout server "
                      "(rollout.engine=vllm_server)"),
    "reward-server": ("vlrft.commands.reward_server_cmd", "serve reward functions over HTTP for the 'remote' reward"),
}


def build_parser() -> argparse.ArgumentParser:
    from vlrft import __version__

    parser = argparse.ArgumentParser(
        prog="vlrft", description="Reinforcement-learning fine-tuning for vision-language models."
    )
    parser.add_argument("--version", action="version", version=f"vlrft {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0])
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _quiet_libraries() -> None:
    """Keep library progress bars and info logs out of the user's terminal."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns its exit code. A torchrun worker exits here instead (`vlrft.parallel.process_exit`), and
    ends with its launcher (a SIGKILLed torchrun leaves no worker training on)."""
    from vlrft.parallel.process_exit import end_with_launcher, exit_process, launched_by_torchrun

    worker = argv is None and launched_by_torchrun()
    if worker:
        end_with_launcher()
    code = _run_command(argv)
    if worker:
        exit_process(code)
    return code


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; dotted overrides may also follow the options (`vlrft plan CFG --gpus 8 a.b=1`):
    argparse fills a `nargs="*"` positional only where it stands, so the words left over join the overrides."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(w.startswith("-") for w in extra):
        args.overrides = [*args.overrides, *extra]
        return args
    return parser.parse_args(argv) if extra else args  # anything else left over: argparse's own error


def _run_command(argv: list[str] | None) -> int:
    _quiet_libraries()
    parser = build_parser()
    args = _parse(parser, argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"vlrft {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"vlrft {args.command}: interrupted" + (f": {exc}" if str(exc) else ""), file=sys.stderr)
        return 128 + int(getattr(exc, "signum", 2))  # 130 after Ctrl-C, 143 after SIGTERM


if __name__ == "__main__":
    sys.exit(main())

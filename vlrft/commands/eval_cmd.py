"""Evaluate a model on the config's eval set (accuracy, pass@k, mean reward) without training."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file; data.eval_files, reward and rollout settings are used")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=runs/x/checkpoints/step_50/model")


def run(args: argparse.Namespace) -> int:
    import json

    from vlrft.config import load_config
    from vlrft.errors import UserError
    from vlrft.trainer import Trainer

    cfg = load_config(args.config, args.overrides, validate=False)
    if not cfg.data.eval_files:
        raise UserError("config: data.eval_files is empty; list the held-out files to evaluate on")
    trainer = Trainer(cfg, evaluate_only=True)
    try:
        metrics = trainer.evaluate(trainer.step_count)
    except BaseException:
        trainer.strategy.close(after_error=True)
        raise
    trainer.strategy.close()
    if trainer.strategy.is_main:
        print(json.dumps(metrics, indent=1, sort_keys=True))
    return 0

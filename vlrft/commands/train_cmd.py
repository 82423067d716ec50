"""Train a policy with RL from a YAML config (works the same under `torchrun`)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 rollout.n=8")


def run(args: argparse.Namespace) -> int:
    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    cfg = load_config(args.config, args.overrides, validate=False)
    trainer = Trainer(cfg)
    try:
        history = trainer.fit()
    except BaseException:
        trainer.strategy.close(after_error=True)
        raise
    trainer.strategy.close()
    if trainer.strategy.is_main and history:
        last = history[-1]
        evals = [h for h in history if "eval/accuracy" in h]
        summary = f"done: {trainer.step_count} steps, output in {cfg.train.output_dir}"
        if evals:
            summary += f"; eval accuracy {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> " \
                       f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})"
        elif "reward/mean" in last:
            summary += f"; last reward/mean {last['reward/mean']:.3f}"
        print(summary, flush=True)
    return 0

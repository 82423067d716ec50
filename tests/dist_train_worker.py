"""Run under torchrun by tests/test_distributed.py: train with DDP, then report every rank's weight checksum."""

import json
import sys

import torch

from vlrft.config import load_config
from vlrft.parallel.process_exit import exit_process
from vlrft.trainer import Trainer


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    trainer = Trainer(load_config(config, sys.argv[3:], validate=False))
    history = trainer.fit()
    weights = trainer.strategy.unwrap(trainer.wrapped).model.state_dict()
    checksum = float(sum(v.double().sum() for v in weights.values()))
    rows = len(trainer.sampler.next_indices())  # this rank's share of the next step's prompts
    gathered = trainer.strategy.all_gather_object({"rank": trainer.strategy.rank, "checksum": checksum, "rows": rows})
    if trainer.strategy.is_main:
        with open(out, "w") as f:
            json.dump({"ranks": gathered, "history": history}, f)
    trainer.strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    exit_process(0)  # as `vlrft train` does under torchrun: no interpreter teardown after the run

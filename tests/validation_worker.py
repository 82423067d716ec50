"""Run under torchrun by tests/test_media_validation.py: each rank reports the images it decoded while the trainer
checked the data at start, and the samples it kept.

`python tests/validation_worker.py OUT OVERRIDE...`: builds a Trainer from the overrides (its start-up check runs
in the constructor); rank 0 writes every rank's report to OUT.
"""

import json
import sys

import torch

from vlrft.config import load_config
from vlrft.data import validate
from vlrft.parallel.process_exit import exit_process
from vlrft.trainer import Trainer


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    decoded: list[str] = []
    check = validate._check_image

    def recording(ref, limits):
        decoded.append(str(ref))
        return check(ref, limits)

    validate._check_image = recording
    trainer = Trainer(load_config(None, overrides, validate=False))
    report = {"rank": trainer.strategy.rank, "decoded": decoded, "kept": [s.answer for s in trainer.train_samples]}
    reports = trainer.strategy.all_gather_object(report)
    if trainer.strategy.is_main:
        with open(out, "w") as f:
            json.dump(reports, f)
    trainer.strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    exit_process(0)  # as `vlrft train` does under torchrun: no interpreter teardown after the run

"""Run under torchrun by tests/test_distributed.py: train until a reward fails, and record what each rank raised.

`python tests/reward_failure_worker.py CONFIG OUT`: each rank writes the error its `fit()` raised and where (or "none")
to OUT.rankN.txt, then the ranks meet at a barrier before exiting, so no rank is stopped by the launcher before it has
written (what `vlrft train` prints races with torchrun stopping the other ranks).
"""

import sys
import traceback
from pathlib import Path

import torch

from vlrft.config import load_config
from vlrft.parallel.process_exit import exit_process
from vlrft.errors import UserError
from vlrft.trainer import Trainer


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    trainer = Trainer(load_config(config, validate=False))
    try:
        trainer.fit()
        raised = "none"
    except UserError as exc:
        raised = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    Path(f"{out}.rank{trainer.strategy.rank}.txt").write_text(raised)
    trainer.strategy.barrier()
    trainer.strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    exit_process(0)

"""Run under torchrun by tests/test_distributed.py: the process groups' timeout is train.dist_timeout_minutes.

`python tests/timeout_worker.py OUT STRATEGY MINUTES`: builds the strategy from a config with that timeout, reads
the timeout of every process group it made and of the engines' tensor-parallel group, then rank 0 stays away for
3x the timeout while the other ranks wait at a barrier; each rank writes what happened to OUT.rankN.json.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from vlrft.config import Config
from vlrft.parallel.process_exit import exit_process
from vlrft.parallel import make_strategy
from vlrft.rollout.colocate import tensor_parallel_group


def group_timeouts(strategy, cfg) -> list[float]:
    """The timeout of every group the strategy made, and of the group a colocated engine's tensor-parallel
    members wait in (built as vLLM/SGLang build it)."""
    _, engine_group = tensor_parallel_group(cfg, strategy.rank, strategy.world_size)  # as vLLM/SGLang build it
    groups = [dist.distributed_c10d._get_default_group(), strategy._cpu_group, engine_group.group]
    return [group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for group in groups if group is not None]


def main() -> None:
    out, name, minutes = sys.argv[1], sys.argv[2], float(sys.argv[3])
    cfg = Config()
    cfg.train.strategy = name
    cfg.train.dist_timeout_minutes = minutes
    cfg.rollout.tensor_parallel_size = 2  # the engines' group: both ranks
    strategy = make_strategy(name, cfg)
    report = {"timeouts_s": group_timeouts(strategy, cfg)}
    if strategy.rank == 0:
        time.sleep(minutes * 60 * 3)  # rank 0 busy alone for longer than the timeout
    else:
        start = time.monotonic()
        try:
            strategy.barrier()
            report["error"] = None
        except Exception as exc:  # gloo's timeout
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["waited_s"] = time.monotonic() - start
    with open(f"{out}.rank{strategy.rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    exit_process(0)  # no teardown: the peers' barrier has failed, the group is unusable

"""Distributed strategies (single process, DDP, FSDP2, DeepSpeed ZeRO-2/3): `make_strategy` picks one by name.

strategy.py holds the interface (`Strategy`), the single process and DDP; fsdp2.py and deepspeed.py implement the
same interface, imported only when named (DeepSpeed is an optional dependency)."""

from __future__ import annotations

import os
from typing import Any

from vlrft.parallel.strategy import STRATEGIES, DDPStrategy, Strategy, rank_info_from_env


def make_strategy(name: str, cfg: Any = None) -> Strategy:
    """The strategy named by `train.strategy`; `cfg` is the run's `Config` (fsdp2/deepspeed read their options)."""
    if name != "single" and not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        from vlrft.errors import UserError

        raise UserError(f"train.strategy={name} runs one process per device started by torchrun; launch with "
                        "`torchrun --nproc_per_node <devices> -m vlrft train CONFIG ...`, or use "
                        "train.strategy=single for one process")
    info = rank_info_from_env()
    if name == "single":
        return Strategy(info)
    if name == "ddp":
        return DDPStrategy(info, cfg)
    if name == "fsdp2":
        from vlrft.parallel.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(info, cfg)
    if name == "deepspeed":  # vlrft/parallel/deepspeed.py (ZeRO-2/3) implements the same interface
        from vlrft.parallel.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(info, cfg)
    raise ValueError(f"unknown train.strategy {name!r}; expected one of {', '.join(STRATEGIES)}")

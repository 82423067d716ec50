"""Distributed strategies (single process, DDP, FSDP2, DeepSpeed ZeRO-2/3); see strategy.py."""

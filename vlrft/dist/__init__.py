"""Distributed strategies (single process, DDP); see strategy.py."""

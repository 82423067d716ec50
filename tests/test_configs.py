"""Every shipped config loads and validates (for the number of processes it is written for)."""

from pathlib import Path

import pytest

from vlrft.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    cfg = load_config(path, world_size=1 if path.name == "demo.yaml" else 8)
    assert cfg.model.path and cfg.data.train_files and cfg.reward.functions
    assert cfg.rollout.global_batch_completions % cfg.rollout.n == 0


def test_the_demo_data_ships_with_the_repository():
    cfg = load_config(CONFIGS[0].parent / "demo.yaml")
    root = CONFIGS[0].parents[1]
    for path in cfg.data.train_files + cfg.data.eval_files + ["datasets/shapes_demo/test_blank.parquet"]:
        assert (root / path).is_file(), path

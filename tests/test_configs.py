"""Every shipped config loads and validates (for the number of processes it is written for), and every GPU
config fits by the memory plan on the hardware its header comment names."""

import re
from pathlib import Path

import pytest

from vlrft.config import load_config
from vlrft.plan import Hardware, plan_for_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


CPU_DEMOS = ("demo.yaml", "zoom_demo.yaml")  # run on one CPU process; every other config names its GPUs
GPU_CONFIGS = [p for p in CONFIGS if p.name not in CPU_DEMOS]
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4}


def named_hardware(path: Path) -> Hardware:
    """The hardware a config's first line names, e.g. '... 2 nodes of 8 x 80 GB GPUs ...'."""
    match = re.search(r"(\w+) nodes? of (\d+) x (\d+) GB GPUs", path.read_text().splitlines()[0])
    assert match, f"{path.name}: the first line must name the hardware, e.g. 'one node of 8 x 80 GB GPUs'"
    nodes = NUMBERS.get(match.group(1)) or int(match.group(1))
    return Hardware(gpus_per_node=int(match.group(2)), nodes=nodes, gpu_memory=int(match.group(3)) * 10 ** 9)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    cfg = load_config(path, world_size=1 if path.name in CPU_DEMOS else named_hardware(path).world_size)
    assert cfg.model.path and cfg.data.train_files and cfg.reward.functions
    assert cfg.rollout.global_batch_completions % cfg.rollout.n == 0


def test_the_demo_data_ships_with_the_repository():
    cfg = load_config(CONFIGS[0].parent / "demo.yaml")
    root = CONFIGS[0].parents[1]
    for path in cfg.data.train_files + cfg.data.eval_files + ["datasets/shapes_demo/test_blank.parquet"]:
        assert (root / path).is_file(), path


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_config_fits_on_the_hardware_it_names(path):
    hardware = named_hardware(path)  # "80 GB" read as 80e9 bytes: below an 80 GiB A100 or a 79.6 GiB H100
    plan = plan_for_config(load_config(path, world_size=hardware.world_size), hardware)
    assert plan.fits, f"{path.name}: {plan.total / 2 ** 30:.1f} GiB per GPU; {plan.suggestions}"


def test_a_32b_class_config_ships_for_several_nodes():
    big = [p for p in GPU_CONFIGS if plan_for_config(load_config(p, validate=False), named_hardware(p)).parameters > 30e9]
    assert big and all(named_hardware(p).nodes >= 2 for p in big)

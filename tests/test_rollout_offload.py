"""Trainer state offloaded to host memory during rollout (train.fsdp.offload_during_rollout) survives the trip.

Runs a real FSDP2 strategy in this process (one rank, gloo on CPU). On CPU the moves are real
copies into new storage (CPU to CPU), so a stale reference anywhere (the optimizer's parameters,
FSDP2's shard bookkeeping, an optimizer state tensor) would make the continued training differ.
"""

import socket

import pytest
import torch
from torch import nn

from vlrft.parallel.strategy import RankInfo, TrainedModel


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Net(nn.Module):
    _no_split_modules = ["Block"]  # what FSDP2Strategy shards one by one, as for a transformers model

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def strategy(monkeypatch):
    from vlrft.parallel.fsdp2 import FSDP2Strategy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    strategy = FSDP2Strategy(RankInfo(0, 1, 0))
    yield strategy
    strategy.close()


def make_part(strategy, seed: int = 0) -> TrainedModel:
    torch.manual_seed(seed)
    module, optimizer = strategy.prepare_trainable(Net(), lambda params: torch.optim.AdamW(params, lr=1e-2))
    return TrainedModel(module, optimizer)


def train_step(strategy, part: TrainedModel, step: int) -> None:
    torch.manual_seed(100 + step)
    x = torch.randn(4, 8)
    part.module(x).pow(2).mean().backward()
    strategy.clip_and_step([part], 1.0, False)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(part: TrainedModel) -> tuple[dict, dict]:
    params = {n: local(p).detach().clone() for n, p in part.module.named_parameters()}
    names = {id(p): n for n, p in part.module.named_parameters()}
    state = {(names[id(p)], k): local(v).clone() for p, s in part.optimizer.state.items() for k, v in s.items()
             if isinstance(v, torch.Tensor)}
    return params, state


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_offload_round_trip_keeps_parameters_and_optimizer_state_bitwise_and_training_identical(strategy):
    offloaded, reference = make_part(strategy), make_part(strategy)
    frozen = make_part(strategy, seed=1).module  # stands in for the reference model
    frozen_before = {n: local(p).detach().clone() for n, p in frozen.named_parameters()}
    train_step(strategy, offloaded, 0)
    train_step(strategy, reference, 0)
    params, state = snapshot(offloaded)
    storage = {n: local(p).data_ptr() for n, p in offloaded.module.named_parameters()}

    strategy.offload_to_cpu([offloaded], [frozen])
    moved = {n: local(p).data_ptr() for n, p in offloaded.module.named_parameters()}
    assert all(moved[n] != storage[n] for n in storage)  # real copies, not the same storage
    assert_equal(snapshot(offloaded)[0], params)
    assert_equal(snapshot(offloaded)[1], state)
    strategy.reload_to_device([offloaded], [frozen])

    assert_equal(snapshot(offloaded)[0], params)
    assert_equal(snapshot(offloaded)[1], state)
    assert_equal({n: local(p).detach() for n, p in frozen.named_parameters()}, frozen_before)
    # the optimizer still steps the module's parameters, and FSDP2 gathers the moved shards: training continues
    # exactly as without the round trip
    for step in (1, 2, 3):
        train_step(strategy, offloaded, step)
        train_step(strategy, reference, step)
    assert_equal(snapshot(offloaded)[0], snapshot(reference)[0])
    assert_equal(snapshot(offloaded)[1], snapshot(reference)[1])
    assert not torch.equal(snapshot(offloaded)[0]["head.weight"], params["head.weight"])  # training moved it


def test_offloaded_for_rollout_only_when_enabled(strategy):
    part = make_part(strategy)
    calls = []
    strategy.offload_to_cpu = lambda parts, frozen: calls.append("offload")
    strategy.reload_to_device = lambda parts, frozen: calls.append("reload")
    strategy.offload_during_rollout = False
    with strategy.offloaded_for_rollout([part], [None]):
        calls.append("rollout")
    strategy.offload_during_rollout = True
    with pytest.raises(RuntimeError):  # an error during rollout still brings the state back
        with strategy.offloaded_for_rollout([part], [None]):
            calls.append("rollout")
            raise RuntimeError("engine failed")
    assert calls == ["rollout", "offload", "rollout", "reload"]


def test_offload_default_is_on_only_for_cuda_with_an_engine_holding_its_own_weights():
    from vlrft.config import FSDPConfig

    for engine, on_gpu, expected in (("vllm", True, True), ("sglang", True, True), ("hf", True, False),
                                     ("vllm", False, False)):
        assert FSDPConfig().offloads_during_rollout(engine, on_gpu) is expected
    assert FSDPConfig(offload_during_rollout=True).offloads_during_rollout("vllm", on_gpu=False) is True
    assert FSDPConfig(offload_during_rollout=False).offloads_during_rollout("vllm", on_gpu=True) is False

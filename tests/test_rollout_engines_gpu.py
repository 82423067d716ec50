"""vLLM and SGLang rollout engines for real: generate, sleep/wake and weight sync with a tiny Qwen2-VL.

Each test needs the engine package and a CUDA GPU and is skipped (with the reason) without them;
run them in an engine stack's environment (constraints/vllm.txt, constraints/sglang.txt) on a GPU:
`python -m pytest tests/test_rollout_engines_gpu.py -v`. One engine per package is built for the
module; the tests run in file order and the last one changes the policy's weights.

What they pin down: the engine's greedy output is the transformers engine's on the same weights and
prompts (images included); the logprobs it returns are the trainer's (softmax of logits / temperature)
at temperature 1 and 0.7; a weight update reaches the engine (a different greedy output), so a
silent sync failure cannot pass.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.config import Config
from vlrft.data import PromptEncoder, Sample
from vlrft.batch import build_sequences
from vlrft.rollout.base import FINISH_LENGTH, Rollouts, SamplingParams
from vlrft.rollout.hf import HFEngine
from vlrft.tokens import TokenSpec

ENGINES = ["vllm", "sglang"]
# Heads of 64 dims: every attention backend of both engines takes them.
SPEC = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, vision_hidden_size=64, vision_heads=1)
ENGINE_KWARGS = {"vllm": {"enforce_eager": True}, "sglang": {"disable_cuda_graph": True}}
# The tiny model's logits are nearly flat (std ~0.2: every greedy step a near-tie, temperature barely matters).
# Sharpened (std ~3) in the policy only: the engine starts from the checkpoint on disk, so matching the
# policy also proves the start-up sync reached it.
LOGIT_SCALE = 15.0


# A near-tie may break either way between the engine's bf16 kernels and transformers: allowed only where
# the two tokens' logprobs (trainer's, at the first difference) are this close.
TIE_NATS = 0.1


def require_engine(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"rollout.engine={name} needs a CUDA GPU and none is visible")
    pytest.importorskip(name, reason=f"{name} is not installed (pip install -c constraints/{name}.txt "
                                     f"-e '.[{name}]'); engine tests need it")


def noise(size: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=ENGINES)
def setup(request, tiny_vlm_dir, tmp_path_factory):
    """(engine, trainer stand-in namespace, batch) for one engine package, shut down after the module."""
    require_engine(request.param)
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.rollout import EngineDeps, make_engine

    folder = tiny_vlm_dir("qwen2_vl", **SPEC)
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(folder), "bfloat16"
    cfg.rollout.engine = request.param
    cfg.rollout.gpu_memory_utilization = 0.3
    cfg.rollout.max_model_len = 1024
    cfg.rollout.engine_kwargs = ENGINE_KWARGS[request.param]
    cfg.data.max_prompt_length = 512
    processor = load_processor(folder)
    model = load_policy(folder, device="cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    trainer = EngineDeps(  # what make_engine builds an engine around
        actor=actor, processor=processor, tokens=tokens, prompts_per_rank=2,
        strategy=SimpleNamespace(rank=0, world_size=1, device=torch.device("cuda", 0)))
    engine = make_engine(cfg, trainer)
    batch = PromptEncoder(processor, cfg.data).encode([
        Sample("text", "Describe a red circle."),
        Sample("image", "<image>What color is the shape?", images=[noise(56, 1)]),
    ]).batch
    yield engine, trainer, batch
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def greedy(engine, batch, max_new_tokens=12):
    return engine.generate(batch, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))


def test_generate_samples_groups_from_our_prompts(setup):
    engine, trainer, batch = setup
    rollouts = engine.generate(batch, SamplingParams(n=3, temperature=1.0, max_new_tokens=16))
    assert len(rollouts) == 6 and rollouts.n == 3 and rollouts.num_prompts == 2
    suppressed = set(trainer.tokens.suppressed_ids)
    for ids, reason, logprobs in zip(rollouts.completion_ids, rollouts.finish_reasons, rollouts.logprobs):
        assert 1 <= len(ids) <= 16 and reason in ("stop", "length")
        assert not suppressed & set(ids)  # vision placeholders are never sampled
        assert len(logprobs) == len(ids) and all(lp <= 1e-4 and np.isfinite(lp) for lp in logprobs)
    assert rollouts.texts == trainer.processor.tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)


def trainer_logprobs(trainer, batch, rollouts, temperature: float) -> list[list[float]]:
    """The trainer's logprobs (ActorVL, the policy the engine was synced from) of each completion."""
    tokens = trainer.tokens
    seqs = build_sequences(batch.prompt_ids, batch.visual, rollouts.completion_ids, rollouts.prompt_index,
                           tokens.pad_id).to("cuda")
    with torch.no_grad():
        lp = trainer.actor.logprobs(seqs, temperature=temperature).logprobs.float().cpu()
    return [lp[r, :len(ids)].tolist() for r, ids in enumerate(rollouts.completion_ids)]


def test_greedy_output_is_the_transformers_engines(setup):
    engine, trainer, batch = setup
    hf = HFEngine(lambda: trainer.actor.model, trainer.processor, trainer.tokens, max_batch_prompts=2)
    ours, reference = greedy(engine, batch, 16), greedy(hf, batch, 16)
    for row, (a, b) in enumerate(zip(ours.completion_ids, reference.completion_ids)):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
        assert k < min(len(a), len(b)), f"row {row}: one completion stopped early: {a} vs {b}"
        # Same prefix up to k: the two next tokens must be a numerical tie under the trainer's model.
        both = Rollouts(n=1, completion_ids=[a[:k + 1], b[:k + 1]], finish_reasons=["length"] * 2)
        lp_a, lp_b = trainer_logprobs(trainer, batch.select([row, row]), both, temperature=1.0)
        assert abs(lp_a[k] - lp_b[k]) < TIE_NATS, (f"row {row}: greedy outputs differ at token {k} "
                                                   f"({a[k]} vs {b[k]}) and it is no tie: {lp_a[k]:.3f} vs "
                                                   f"{lp_b[k]:.3f}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_returned_logprobs_are_the_trainers(setup, temperature):
    engine, trainer, batch = setup
    rollouts = engine.generate(batch, SamplingParams(n=3, temperature=temperature, max_new_tokens=16))
    expected = trainer_logprobs(trainer, batch, rollouts, temperature)
    diffs = torch.tensor([abs(x - y) for got, want in zip(rollouts.logprobs, expected) for x, y in zip(got, want)])
    # bf16 engine vs fp32 trainer: small on average, never far off (with these logits a wrong temperature
    # moves a token's logprob by ~1 nat on average).
    assert diffs.mean() < 0.05 and diffs.max() < 0.5, (diffs.mean().item(), diffs.max().item())


def test_sleep_frees_memory_and_wake_restores_the_same_policy(setup):
    engine, _, batch = setup
    before = greedy(engine, batch).completion_ids
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    torch.cuda.synchronize()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # the KV cache (and weights) went back to the trainer
    engine.wake()
    assert greedy(engine, batch).completion_ids == before  # weights were reloaded from the policy


def test_update_weights_while_asleep_reaches_the_engine(setup):
    engine, trainer, batch = setup
    max_new = 12
    assert greedy(engine, batch, max_new).completion_ids != [[0] * max_new] * 2  # not already the target
    engine.sleep()
    with torch.no_grad():
        # A zero final norm makes every hidden state 0, so all logits tie and greedy picks token 0 forever.
        trainer.actor.model.model.language_model.norm.weight.zero_()
    engine.update_weights(trainer.actor)
    engine.wake()
    rollouts = greedy(engine, batch, max_new)
    assert rollouts.completion_ids == [[0] * max_new] * 2
    assert rollouts.finish_reasons == [FINISH_LENGTH] * 2

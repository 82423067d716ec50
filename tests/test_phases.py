"""Each phase of a training step runs from its explicit dependencies, with no `Trainer`.

The phases (`make_engine`, `collect`, `make_experience`, `update`, `evaluate`) take small frozen dataclasses that
name what they need, so a tool or test can run one alone. Here they run in step order on a real
tiny Qwen2-VL, the HF rollout engine and a real reward function, in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlrft.config import load_config
from vlrft.data import PromptEncoder, PromptSampler, read_samples
from vlrft.parallel import make_strategy
from vlrft.parallel.strategy import ModelSource, TrainedModel
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_processor
from vlrft.rewards import RewardSet
from vlrft.rollout import EngineDeps, SamplingParams, make_engine
from vlrft.rollout.hf import HFEngine
from vlrft.tokens import TokenSpec
from vlrft.trainer.collect import CollectDeps, collect
from vlrft.trainer.evaluate import EvalDeps, evaluate
from vlrft.trainer.experience import Batching, ExperienceDeps, make_experience
from vlrft.trainer.trainer import make_optimizer
from vlrft.trainer.update import UpdateDeps, update

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=8, test_size=3))


def test_each_phase_runs_from_explicit_dependencies_without_a_trainer(tiny_vlm_dir, shapes):
    torch.manual_seed(0)
    model_dir = tiny_vlm_dir("qwen2_vl")
    cfg = load_config(None, [f"model.path={model_dir}", "data.min_pixels=784", "data.max_pixels=3136",
                             "rollout.n=2", "rollout.global_batch_completions=4", "rollout.max_new_tokens=5",
                             f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", "train.lr=1e-3"])
    strategy = make_strategy("single")
    processor = load_processor(str(model_dir), False)
    model = strategy.load_model(ModelSource(str(model_dir), "float32", cfg.model.attn_implementation, False),
                                trainable=True)
    model.config.use_cache = False
    model.train()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, int(model.config.image_token_id), int(model.config.video_token_id),
                    suppressed_ids=tokens.suppressed_ids)  # the engine never samples them either
    policy, optimizer = strategy.prepare_trainable(actor, lambda params: make_optimizer(params, cfg.train))
    encoder = PromptEncoder(processor, cfg.data)
    engine = make_engine(cfg, EngineDeps(actor=actor, processor=processor, tokens=tokens, strategy=strategy,
                                         prompts_per_rank=2, encoder=encoder))
    assert isinstance(engine, HFEngine)  # rollout.engine=hf, the default
    rewards = RewardSet.from_config(cfg.reward)
    samples = read_samples(shapes["train"])
    batching = Batching(pad_id=tokens.pad_id, device=strategy.device, micro_batch=1)
    sum_reduce = lambda t: strategy.all_reduce(t, "sum")  # noqa: E731

    collected = collect(CollectDeps(
        algo=cfg.algorithm, rollout=cfg.rollout, prompts_per_rank=2, samples=samples,
        sampler=PromptSampler(len(samples), 2, seed=0), encoder=encoder, engine=engine,
        sampling=SamplingParams.from_config(cfg.rollout), rewards=rewards, strategy=strategy), step=1)
    assert len(collected.prompts) == 2 and len(collected.rollouts) == 4  # two whole groups of n=2
    assert collected.rewards.shape == (4,) and bool(((collected.rewards >= 0) & (collected.rewards < 1)).all())

    exp = make_experience(ExperienceDeps(algo=cfg.algorithm, group_size=2, batching=batching, temperature=1.0,
                                         kl_coef=0.0, old_policy=actor, reduce=sum_reduce), collected)
    width = max(len(c) for c in collected.rollouts.completion_ids)
    assert exp.advantages.shape == exp.old_logprobs.shape == (4, width)
    # The old-logprob pass scores the sampled tokens as the engine did (same weights, float32).
    torch.testing.assert_close(exp.old_logprobs * exp.token_mask, exp.engine_logprobs * exp.token_mask,
                               atol=1e-3, rtol=0)
    # GRPO: each group's advantages are centred.
    per_row = (exp.advantages * exp.mask).sum(1) / exp.mask.sum(1)
    assert abs(float(per_row[:2].sum())) < 1e-5 and abs(float(per_row[2:].sum())) < 1e-5

    before = [p.detach().clone() for p in actor.parameters()]
    stats, skipped = update(UpdateDeps(
        algo=cfg.algorithm, strategy=strategy, batching=batching, policy=policy,
        trained_parts=[TrainedModel(policy, optimizer)], watched_params=list(actor.parameters()), ppo_epochs=1,
        mini_batch_per_rank=4, max_grad_norm=1.0, max_new_tokens=5, temperature=1.0, kl_coef=0.0, step=1,
        lr=cfg.train.lr), collected, exp)
    assert skipped == 0 and "actor/grad_norm" in stats.means()
    assert any(not torch.equal(b, p) for b, p in zip(before, actor.parameters()))  # one optimizer step ran

    metrics = evaluate(EvalDeps(
        samples=read_samples(shapes["test"]), rank=0, world_size=1, encoder=encoder, engine=engine,
        sampling=SamplingParams.from_config(cfg.rollout, n=2, temperature=1.0), batch_prompts=2, rewards=rewards,
        accuracy_key=next(iter(rewards.keys)), reduce=sum_reduce), step=1)
    assert metrics["eval/skipped"] == 0.0 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert 0.0 <= metrics["eval/pass@2"] <= 1.0 and 0 < metrics["eval/completions/mean_length"] <= 5

"""One training step (experience + update) from fixed rollouts, for the token-budget micro-batch tests.

Imported by tests/test_micro_batches.py (one process) and run under torchrun by it
(`python budget_worker.py MODEL IMAGES STRATEGY OUT`): each rank takes whole groups of the same
fixed rollouts, with completion lengths that differ between ranks so their token budgets form
different numbers of micro-batches, and rank 0 saves the trained weights to OUT.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from vlrft.config import load_config
from vlrft.data import PromptEncoder, Sample
from vlrft.parallel.process_exit import exit_process
from vlrft.parallel import make_strategy
from vlrft.parallel.strategy import TrainedModel
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_policy, load_processor
from vlrft.rollout.base import Rollouts
from vlrft.tokens import TokenSpec
from vlrft.trainer.collect import Collected
from vlrft.trainer.experience import Batching, ExperienceDeps, make_experience
from vlrft.trainer.micro_batches import share_every_forward
from vlrft.trainer.update import UpdateDeps, update

GROUP = 4
# Completion lengths per group: groups 0 and 2 (rank 0 of 2) long and very uneven, 1 and 3 (rank 1) short.
LENGTHS = [[2, 37, 5, 30], [1, 3, 2, 4], [40, 1, 24, 9], [2, 2, 5, 1]]


def write_images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (56, 84), (200, 40, 40)).save(folder / "a.png")
    Image.new("RGB", (84, 56), (40, 40, 200)).save(folder / "b.png")
    return folder


def make_collected(model_dir: Path, images: Path, groups: list[int],
                   constant_groups: tuple[int, ...] = ()) -> tuple[Collected, TokenSpec]:
    """Fixed rollouts of these groups: image and text prompts, completion lengths from `LENGTHS`; the groups in
    `constant_groups` score 1 on every row (zero advantage under GRPO)."""
    processor = load_processor(str(model_dir))
    samples = [Sample(id="two", prompt="<image><image>Same shapes?",
                      images=[str(images / "a.png"), str(images / "b.png")]),
               Sample(id="text", prompt="Hello there, count to three"),
               Sample(id="one", prompt="<image>Color?", images=[str(images / "b.png")]),
               Sample(id="long", prompt="<image>What is in this picture, and how many of them are there?",
                      images=[str(images / "a.png")])]
    cfg = load_config(None, ["data.min_pixels=784", "data.max_pixels=6272"], validate=False)
    prompts = PromptEncoder(processor, cfg.data).encode([samples[g] for g in groups]).batch
    tokens = TokenSpec.from_model(processor, load_policy(model_dir).config)
    completions, rewards = [], []
    for g in groups:  # each group from its own seed: the same rows whichever rank holds them
        gen = torch.Generator().manual_seed(7 + g)
        for length in LENGTHS[g]:
            completions.append(torch.randint(100, 400, (length,), generator=gen).tolist())
        rewards += ([1.0] * GROUP if g in constant_groups else
                    torch.rand(GROUP, generator=torch.Generator().manual_seed(100 + g)).tolist())
    rollouts = Rollouts(n=GROUP, completion_ids=completions, finish_reasons=["stop"] * len(completions))
    collected = Collected(prompts, rollouts, torch.tensor(rewards), {}, groups_seen=len(groups), zero_std_groups=0,
                          filled_zero_std=0, skipped_prompts=0, rounds=1)
    return collected, tokens


def train_step(model_dir: Path, collected: Collected, tokens: TokenSpec, strategy, *, max_tokens: int,
               micro_batch: int = 4, loss_agg: str = "token-mean", mini_batches: int = 2, agree=None,
               split: bool | None = None, plain: bool = False, skip_zero_advantage: bool = True):
    """(experience, loss statistics, trained actor) of one step: old and reference logprobs, `mini_batches` SGD
    steps (the second with a ratio != 1), KL in the loss. `split`: completions in classes of similar length
    (`ActorVL.split_completion_widths`); None: as the trainer sets it (off under sharding strategies).
    `plain`: no KL and no entropy bonus, so rows of zero advantage add nothing to the loss and
    `skip_zero_advantage` leaves them out."""
    split = not strategy.balances_vision_calls if split is None else split
    torch.manual_seed(0)
    kl_coef, entropy_coef = (0.0, 0.0) if plain else (0.1, 0.01)
    cfg = load_config(None, [f"model.path={model_dir}", f"algorithm.loss_agg={loss_agg}", f"algorithm.kl_coef={kl_coef}",
                             "algorithm.kl_in=loss", f"algorithm.entropy_coef={entropy_coef}"], validate=False)
    model = load_policy(model_dir)
    model.config.use_cache = False
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    ref = ActorVL(copy.deepcopy(model).eval(), tokens.image_token_id, tokens.video_token_id,
                  suppressed_ids=tokens.suppressed_ids)
    for p in ref.parameters():
        p.requires_grad_(False)
    actor.split_completion_widths = ref.split_completion_widths = split
    policy, optimizer = strategy.prepare_trainable(actor, lambda params: torch.optim.SGD(params, lr=0.05))
    strategy.balance_vision_calls([actor, ref])  # as the trainer does: sharded ranks run the vision tower together
    if (max_tokens > 0 or plain) and strategy.balances_vision_calls:
        share_every_forward([actor, ref])  # ... and their blocks equally often (as the trainer does)
    batching = Batching(pad_id=tokens.pad_id, device=strategy.device, micro_batch=micro_batch, max_tokens=max_tokens,
                        agree_count=agree, split_widths=split)
    reduce = lambda t: strategy.all_reduce(t, "sum")  # noqa: E731
    exp = make_experience(ExperienceDeps(algo=cfg.algorithm, group_size=GROUP, batching=batching, temperature=1.0,
                                         kl_coef=kl_coef, old_policy=actor, ref=None if plain else ref, reduce=reduce),
                          collected)
    n_rows = len(collected.rollouts)
    stats, skipped = update(UpdateDeps(
        algo=cfg.algorithm, strategy=strategy, batching=batching, policy=policy,
        trained_parts=[TrainedModel(policy, optimizer)], watched_params=list(actor.parameters()), ppo_epochs=1,
        mini_batch_per_rank=n_rows // mini_batches, max_grad_norm=1e9, max_new_tokens=40, temperature=1.0,
        kl_coef=kl_coef, step=1, lr=0.05, skip_zero_advantage_rows=skip_zero_advantage), collected, exp)
    assert skipped == 0
    return exp, stats, actor


def _strategy(name: str):
    """ddp, fsdp2, or zero2/zero3: DeepSpeed clipping at train_step's 1e9 (i.e. not), and taking its plain SGD
    (DeepSpeed refuses optimizers it has not tested with ZeRO unless told; the trainer's AdamW it knows)."""
    if not name.startswith("zero"):
        return make_strategy(name)
    cfg = load_config(None, ["train.strategy=deepspeed", f"train.deepspeed.zero_stage={name[-1]}",
                             "train.max_grad_norm=1e9", "train.micro_batch_completions_per_rank=4"], validate=False)
    strategy = make_strategy("deepspeed", cfg)
    ds_config = strategy.ds_config
    strategy.ds_config = lambda **kw: {**ds_config(**kw), "zero_allow_untested_optimizer": True}
    return strategy


def main(model_dir: str, images: str, strategy_name: str, out: str, max_tokens: str = "120",
         scenario: str = "budget") -> None:
    """`scenario` "zero_advantage": rank 0's groups (0 and 2) all score alike, so with no KL and no entropy
    bonus rank 0 has no row to train and runs a filler beside rank 1's micro-batches."""
    strategy = _strategy(strategy_name)
    groups = list(range(strategy.rank, len(LENGTHS), strategy.world_size))
    plain = scenario == "zero_advantage"
    collected, tokens = make_collected(Path(model_dir), Path(images), groups, constant_groups=(0, 2) if plain else ())
    counts = []

    def agree(count: int) -> int:  # what the trainer passes (Trainer.max_count), recording each rank's own count
        counts.append(count)
        return int(strategy.all_reduce(torch.tensor([count]), "max").item())

    _, stats, actor = train_step(Path(model_dir), collected, tokens, strategy, max_tokens=int(max_tokens),
                                 mini_batches=1, agree=agree, plain=plain)
    all_counts = strategy.all_gather_object(counts)
    weights = {}
    with strategy.gathered(list(actor.parameters())):  # ZeRO-3: whole parameters on every rank
        for name, p in actor.named_parameters():
            weights[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    means = stats.reduce(lambda t: strategy.all_reduce(t, "sum"), lambda t: strategy.all_reduce(t, "max")).means()
    if strategy.is_main:
        torch.save({"weights": weights, "counts": all_counts, "means": means}, out)
    strategy.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:7])
    exit_process(0)  # as `vlrft train` does under torchrun: no interpreter teardown after the run

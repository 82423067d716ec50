"""Run under torchrun by tests/test_deepspeed.py: the NaN/inf skip of `DeepSpeedStrategy.clip_and_step`.

`python deepspeed_worker.py OUT.json` trains two small models (a "policy" and a "critic", stepped
together) with ZeRO-2 and then ZeRO-3 for four steps of two micro-batches each:
step 1 is normal; in step 2 rank 1's policy loss is NaN (its gradients become NaN); in step 3 rank 1
only reports a non-finite loss (`nonfinite_local`) while every gradient is finite; step 4 is normal.
Rank 0 writes, per stage, which steps were skipped, whether the skipped steps left every weight
bitwise unchanged, and the largest difference from one process that trains on steps 1 and 4 only.
Under "padding" it writes how the diverged-weights check (`parameters_finite`) judges a ZeRO-3 shard
whose padding holds NaN bits, and a shard with a real NaN.
"""

import json
import sys

import torch
from torch import nn

from vlrft.config import load_config
from vlrft.parallel.deepspeed import DeepSpeedStrategy
from vlrft.parallel.process_exit import exit_process
from vlrft.parallel.strategy import StepResult, TrainedModel, rank_info_from_env
from vlrft.trainer.update import parameters_finite, weights_norm_sq

MAX_NORM = 0.05  # small, so clipping is active on every applied step


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def batches(world: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [[torch.randn(2 * world, 8, generator=generator) for _ in range(2)] for _ in range(4)]


def loss_of(model: nn.Module, x: torch.Tensor, world: int) -> torch.Tensor:
    # Summed over the global mini-batch and scaled by the world size, as the trainer's losses are
    # (ranks' gradients are averaged).
    return model(x).pow(2).sum() / (x.shape[0] * world * 2) * world


def full_weights(strategy: DeepSpeedStrategy, module: nn.Module) -> list[torch.Tensor]:
    params = list(module.parameters())
    with strategy.gathered(params):
        return [p.detach().clone() for p in params]


def train_sharded(stage: int) -> dict:
    cfg = load_config(None, ["train.strategy=deepspeed", f"train.deepspeed.zero_stage={stage}",
                             f"train.max_grad_norm={MAX_NORM}", "train.micro_batch_completions_per_rank=2"], validate=False)
    strategy = DeepSpeedStrategy(rank_info_from_env(), cfg)
    rank, world = strategy.rank, strategy.world_size
    parts, modules = [], []
    for seed in (0, 1):
        module = make_model(seed)
        engine, optimizer = strategy.prepare_trainable(module, make_optimizer)
        parts.append(TrainedModel(engine, optimizer))
        modules.append(module)
    skipped, unchanged = [], []
    for step, micro in enumerate(batches(world)):
        before = [full_weights(strategy, m) for m in modules]
        nonfinite = False
        for x in micro:
            mine = x[rank * 2:(rank + 1) * 2]
            for index, part in enumerate(parts):
                loss = loss_of(part.module, mine, world)
                if step == 1 and rank == 1 and index == 0:
                    loss = loss * float("nan")
                nonfinite |= not bool(torch.isfinite(loss))
                strategy.backward(loss, part.module)
        if step == 2 and rank == 1:
            nonfinite = True
        result: StepResult = strategy.clip_and_step(parts, MAX_NORM, nonfinite)
        skipped.append(result.skipped)
        after = [full_weights(strategy, m) for m in modules]
        unchanged.append(all(torch.equal(a, b) for ws_a, ws_b in zip(before, after) for a, b in zip(ws_a, ws_b)))
    return {"skipped": skipped, "unchanged": unchanged,
            "weights": [[w.tolist() for w in full_weights(strategy, m)] for m in modules], "strategy": strategy}


def train_single(world: int) -> list[list[torch.Tensor]]:
    """The same two models in one process, stepped on steps 1 and 4 only (the others are skipped)."""
    models = [make_model(seed) for seed in (0, 1)]
    optimizers = [make_optimizer(list(m.parameters())) for m in models]
    for step, micro in enumerate(batches(world)):
        if step in (1, 2):
            continue
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            for x in micro:
                (model(x).pow(2).sum() / (x.shape[0] * 2)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
    return [[p.detach() for p in m.parameters()] for m in models]


def nan_in_zero3_padding(strategy: DeepSpeedStrategy) -> dict:
    """ZeRO-3 pads each parameter's shards to one size and never initializes the padding, which then holds
    any bits, NaN ones included: a critic's 1-element value-head bias is all padding on rank 1. Put NaN
    there (what the memory may hold), then a NaN in a real element (rank 0 holds the bias's one value)."""
    head = nn.Linear(4, 1)  # weight: 2 real elements per rank; bias: rank 0's 1 real element, rank 1's padding
    strategy.prepare_trainable(head, make_optimizer)
    params = list(head.parameters())
    start = strategy.rank * head.bias.ds_tensor.numel()
    head.bias.ds_tensor.view(-1)[max(head.bias.ds_numel - start, 0):] = float("nan")

    def on_some_rank(flag: bool) -> bool:
        return bool(strategy.all_reduce(torch.tensor([float(flag)]), "max").item())

    padded = on_some_rank(not bool(torch.isfinite(head.bias.ds_tensor).all()))
    judged_diverged = on_some_rank(not parameters_finite(params))
    norm_overflowed = on_some_rank(not bool(torch.isfinite(weights_norm_sq(params))))  # the norm-change check's input
    if strategy.rank == 0:
        head.bias.ds_tensor.view(-1)[0] = float("nan")
    real_nan_seen = on_some_rank(not parameters_finite(params))
    return {"padding_holds_nan": padded, "padding_nan_judged_finite": not judged_diverged,
            "padding_nan_left_out_of_the_norm": not norm_overflowed, "real_nan_seen": real_nan_seen}


def main(out: str) -> None:
    results = {}
    strategy = None
    for stage in (2, 3):
        run = train_sharded(stage)
        strategy = run.pop("strategy")
        expected = train_single(strategy.world_size)
        run["max_diff"] = max((torch.tensor(w) - e).abs().max().item()
                              for ws, es in zip(run.pop("weights"), expected) for w, e in zip(ws, es))
        results[f"zero{stage}"] = run
    results["padding"] = nan_in_zero3_padding(strategy)  # the last strategy is ZeRO-3
    if strategy.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    exit_process(0)  # as `vlrft train` does under torchrun: no interpreter teardown after the run

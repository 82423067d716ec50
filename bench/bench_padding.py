#!/usr/bin/env python
"""Padding in the training forward: row-count micro-batches vs token-budget ones (`train.max_tokens_per_micro_batch`).

    python bench/bench_padding.py [--prompts 8] [--group 8] [--micro-batch 4] [--budget 4096] [--repeats 3]

Completion lengths are natural (stopped at EOS), drawn from a seed, not sampled from a model: each
prompt gets a log-normal mean length (median 120 tokens, sigma 0.6: some prompts need short
answers, some long), and each of its `--group` completions a log-normal length around that mean
(sigma 0.35), clipped to [1, --max-new-tokens]. Prompts are text-only, 48-128 random token ids. A random
Qwen2-VL (`--hidden`, `--layers`; built locally with `vlrft.models.tiny`) runs the training
forward (`ActorVL`, prompt sharing on) and backward of every micro-batch of the batch, one thread.

Four settings: micro-batches of `--micro-batch` rows or by the budget, each with one padded
completion call per micro-batch (what sharding strategies run) or one call per class of similar
lengths (`ActorVL.split_completion_widths`, the default elsewhere). Printed per setting:
micro-batches, tokens the forwards process (padding included:
`vlrft.trainer.micro_batches.forward_tokens`, checked against the built batches' shapes), that
over (a) their non-pad tokens (each micro-batch's distinct prompts once + its completions; a prompt
whose rows sit in two micro-batches runs, and counts, twice) and over (b) the least any forward
needs (each prompt once in the whole batch + every completion), and the time of forward+backward
over the whole batch, wall and process CPU time (less disturbed by other load on a shared
machine): min/median/max over `--repeats` interleaved repeats.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def natural_lengths(seed: int, prompts: int, group: int, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, completion lengths row by row, group by group): see the module docstring."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(48, 129, (prompts,), generator=gen).tolist()
    means = 120 * torch.exp(0.6 * torch.randn(prompts, generator=gen))
    completion = [(m * torch.exp(0.35 * torch.randn(group, generator=gen))).round().clamp(1, max_new_tokens)
                  for m in means]
    return prompt_lengths, torch.cat(completion).int().tolist()


def make_batch(seed: int, prompts: int, group: int, max_new_tokens: int, vocab: int):
    """A stand-in for `Collected` with what the training forward reads: prompt ids, completions, row -> prompt."""
    import torch

    from vlrft.vision import VisualBatch

    prompt_lengths, completion_lengths = natural_lengths(seed, prompts, group, max_new_tokens)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt_ids = [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
    completion_ids = [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in completion_lengths]
    row_prompt = [i // group for i in range(prompts * group)]
    return SimpleNamespace(prompts=SimpleNamespace(prompt_ids=prompt_ids, visual=VisualBatch.empty(prompts, 2)),
                           rollouts=SimpleNamespace(completion_ids=completion_ids, prompt_index=row_prompt))


def built_tokens(actor, seqs) -> int:
    """Token positions of the actor's forward over this SequenceBatch, from its tensors and completion calls."""
    rows, width_c = seqs.completion_mask.shape
    classes = actor._width_classes(seqs)
    if classes is not None:  # one prompt pass, then a completion call per class padded to its own width
        return seqs.visual.num_samples * seqs.prompt_width + sum(len(m) * w for m, w in classes)
    if seqs.visual.num_samples < rows:  # shared path: each distinct prompt once, then every row's completion
        return seqs.visual.num_samples * seqs.prompt_width + rows * width_c
    return seqs.input_ids.numel()


def forward_backward(actor, batching, collected, plan) -> tuple[float, float]:
    """(wall, CPU) seconds for forward + backward of every micro-batch of the plan (a GRPO-like token-sum loss)."""
    from vlrft.trainer.experience import sequences_for

    start, start_cpu = time.perf_counter(), time.process_time()
    for micro in plan:
        seqs = sequences_for(batching, collected, micro.rows)
        out = actor(seqs)
        (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    actor.zero_grad(set_to_none=True)
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch of the row-count plan")
    parser.add_argument("--budget", type=int, default=4096, help="train.max_tokens_per_micro_batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy
    from vlrft.models.tiny import TinySpec, build_tiny_vlm
    from vlrft.trainer.experience import Batching, plan_micro_batches, sequences_for
    from vlrft.trainer.micro_batches import RowLengths, forward_tokens, real_tokens

    folder = Path(tempfile.mkdtemp(prefix="bench_padding_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    build_tiny_vlm(folder, TinySpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                    intermediate_size=2 * args.hidden, vocab_size=args.vocab))
    model = load_policy(folder)
    model.config.use_cache = False
    actor = ActorVL(model, int(model.config.image_token_id), int(model.config.video_token_id))
    assert actor.share_prompts
    vocab = model.get_input_embeddings().num_embeddings  # the tokenizer learns at most --vocab tokens
    collected = make_batch(args.seed, args.prompts, args.group, args.max_new_tokens, vocab)
    lengths = RowLengths.of(collected.prompts.prompt_ids, collected.rollouts.completion_ids,
                            collected.rollouts.prompt_index)
    rows = list(range(len(collected.rollouts.completion_ids)))
    least = real_tokens(lengths, rows)
    cpu = torch.device("cpu")
    # (batching, ActorVL.split_completion_widths): one padded completion call per micro-batch (as under sharding
    # strategies, and before width classes), or one call per class of similar lengths.
    settings = {
        f"rows of {args.micro_batch}, 1 call": (Batching(0, cpu, args.micro_batch, split_widths=False), False),
        f"rows of {args.micro_batch}, classes": (Batching(0, cpu, args.micro_batch), True),
        f"budget {args.budget}, 1 call": (Batching(0, cpu, args.micro_batch, max_tokens=args.budget,
                                                   split_widths=False), False),
        f"budget {args.budget}, classes": (Batching(0, cpu, args.micro_batch, max_tokens=args.budget), True),
    }
    plans = {name: plan_micro_batches(b, collected, rows) for name, (b, _) in settings.items()}
    completion = [lengths.completion_length[r] for r in rows]
    print(f"{len(rows)} completions ({args.prompts} prompts x {args.group}), natural lengths from seed {args.seed}: "
          f"completion min/median/max {min(completion)}/{int(statistics.median(completion))}/{max(completion)}, "
          f"prompts {min(lengths.prompt_length)}-{max(lengths.prompt_length)} tokens; least tokens a forward needs "
          f"(each prompt once + completions): {least}")
    print(f"model: Qwen2-VL hidden {args.hidden}, {args.layers} layers, vocab {vocab}; one thread, "
          f"{args.repeats} interleaved repeats")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    first = next(iter(settings))
    forward_backward(actor, settings[first][0], collected, plans[first][:1])  # warm-up
    for _ in range(args.repeats):
        for name, (batching, split) in settings.items():
            actor.split_completion_widths = split
            times[name].append(forward_backward(actor, batching, collected, plans[name]))
    print(f"{'micro-batching':<22} {'micro':>5} {'tokens':>7} {'/non-pad':>8} {'/least':>7}  "
          "forward+backward s, wall (min/med/max) | CPU (min/med/max)")
    for name, (batching, split) in settings.items():
        plan = plans[name]
        tokens = sum(forward_tokens(lengths, m.rows, split_widths=split) for m in plan)
        actor.split_completion_widths = split
        built = sum(built_tokens(actor, sequences_for(batching, collected, m.rows)) for m in plan)
        assert built == tokens, (name, built, tokens)
        non_pad = sum(real_tokens(lengths, m.rows) for m in plan)
        wall, cpu = sorted(t[0] for t in times[name]), sorted(t[1] for t in times[name])
        print(f"{name:<22} {len(plan):>5} {tokens:>7} {tokens / non_pad:>7.3f}x {tokens / least:>6.3f}x  "
              f"{wall[0]:.2f} / {statistics.median(wall):.2f} / {wall[-1]:.2f} | "
              f"{cpu[0]:.2f} / {statistics.median(cpu):.2f} / {cpu[-1]:.2f}")


if __name__ == "__main__":
    main()

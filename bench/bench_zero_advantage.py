#!/usr/bin/env python
"""Training time when some groups' rewards are all equal: their rows left out of the update, or trained on.

    python bench/bench_zero_advantage.py [--share 0.75] [--steps 14] [--group 8] [--batch 32]

A random Qwen2-VL (hidden 256, 4 layers, vocabulary 512, built locally with `vlrft.models.tiny`)
trains with GRPO (no KL, no entropy bonus) on the shapes data, 112 px images, completions forced to
64 tokens. The reward (`share_constant_reward`) gives about `--share` of the prompts (chosen by a
hash of the image) the same score on every completion, so their groups have zero advantage, and the
rest a hash of the completion text. One trainer alternates `train.skip_zero_advantage_rows` on and
off from step to step (interleaved; the first 2 steps are warm-up). Printed: the train phase's wall
time min/median/max for each, and the share of rows left out at each step with the option on. The
update is the same either way (tests/test_micro_batches.py); only the time differs. One thread.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def share_constant_reward(completions, images, share: float = 0.75, **kwargs) -> list[float]:
    """1.0 for every completion of a prompt whose image hashes below `share`; else a hash of the text in [0, 1)."""
    scores = []
    for text, prompt_images in zip(completions, images):
        if zlib.crc32(str(prompt_images).encode()) % 1000 < share * 1000:
            scores.append(1.0)
        else:
            scores.append(zlib.crc32(text.encode()) % 1000 / 1000)
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--share", type=float, default=0.75, help="share of prompts whose completions all score alike")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="completions per step")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch

    from vlrft.config import load_config
    from examples.shapes import ShapesSpec, make_shapes
    from vlrft.models.tiny import TinySpec, build_tiny_vlm
    from vlrft.trainer import Trainer

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_zero_advantage_"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    pixels = 112 * 112
    model = build_tiny_vlm(work / "model", TinySpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                                    intermediate_size=1024, min_pixels=pixels, max_pixels=pixels))
    data = make_shapes(work / "data", ShapesSpec(tasks=("color",), image_size=112, train_size=256, test_size=0))
    reward = f"{{name: '{Path(__file__).resolve()}:share_constant_reward', kwargs: {{share: {args.share}}}}}"
    cfg = load_config(None, [
        f"model.path={model}", "model.dtype=float32", f"data.train_files=[{data['train']}]",
        f"data.min_pixels={pixels}", f"data.max_pixels={pixels}", f"rollout.n={args.group}",
        f"rollout.global_batch_completions={args.batch}", "rollout.max_new_tokens=64", "rollout.min_new_tokens=64",
        f"reward.functions=[{reward}]", f"train.output_dir={work / 'run'}", "train.micro_batch_completions_per_rank=8",
        "train.eval_before_training=false", "logging.progress=false", "logging.tensorboard=false",
        "logging.completions_every=0"])
    trainer = Trainer(cfg)
    times: dict[bool, list[float]] = {True: [], False: []}
    left_out = []
    for step in range(args.steps):
        skip = step % 2 == 0
        trainer.cfg.train.skip_zero_advantage_rows = skip  # read by each step's update
        metrics = trainer.train_step()
        if step >= 2:
            times[skip].append(metrics["time/train"])
            if skip:
                left_out.append(metrics.get("actor/zero_advantage_rows_skipped", 0.0))
    print(f"{args.batch} completions per step, groups of {args.group}, about {args.share:.0%} of prompts scoring alike; "
          f"train phase wall s min/median/max over {len(times[True])} interleaved steps each")
    for skip, label in ((True, "zero-advantage rows left out"), (False, "every row trained")):
        v = times[skip]
        print(f"  {label:<30} {min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}")
    print(f"  rows left out per step (option on): {', '.join(f'{s:.2f}' for s in left_out)}")
    print(f"  median train time ratio: {statistics.median(times[True]) / statistics.median(times[False]):.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Train a few steps of a randomly initialised, realistically shaped Qwen2.5-VL under each strategy; print speed and memory.

    python tools/gpu_bench.py --size 3b --gpus 8                 # a GPU machine: single, ddp, fsdp2, deepspeed
    python tools/gpu_bench.py --size 1.5b --strategies fsdp2 --gpus 8 --json bench.json
    python tools/gpu_bench.py --tiny                             # CPU smoke test (tiny model, one process)

The model is built from a config (no download): the Qwen2.5-VL vision tower (32 blocks of 1280)
in front of a Qwen2.5 language model of the chosen size with the real 151,936-token vocabulary, a
locally trained tokenizer, random weights. Rollouts use the hf engine on the shapes demo prompts
(images upscaled to `--image-pixels`), every completion forced to `--new-tokens` tokens.

For each strategy the driver starts one run (`torchrun --nproc_per_node GPUS` for ddp/fsdp2/
deepspeed) and prints: rollout tokens/s (completion tokens generated per second, all ranks),
training tokens/s (prompt + completion tokens through forward and backward per second), the MFU
of the training phase (its matmul FLOPs / time / peak bf16 FLOP/s of all GPUs; see `train_flops`),
and the peak memory per GPU beside the `vlrft plan` figure for the same config. Strategies that
`vlrft.parallel.strategy.make_strategy` does not know are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen2.5 language-model shapes (hidden, intermediate, layers, heads, kv heads) behind the Qwen2.5-VL vision tower.
SIZES = {
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
}
VOCAB = 151936
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                   "B200": 2250e12}


def build_model(out: Path, size: str) -> Path:
    """Write a random-weight Qwen2.5-VL of `size` ("tiny" or a key of SIZES) with a local processor to `out`."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlrft.models.tiny import TinySpec, build_config, build_processor, build_tiny_vlm

    if (out / "config.json").is_file():
        return out
    if size == "tiny":
        return build_tiny_vlm(out, TinySpec(arch="qwen2_5_vl"))
    hidden, inter, layers, heads, kv = SIZES[size]
    spec = TinySpec(arch="qwen2_5_vl", hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                    num_heads=heads, num_kv_heads=kv, vision_depth=32, vision_hidden_size=1280, vision_heads=16,
                    min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, tie_word_embeddings=True)
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    config.text_config.vocab_size = VOCAB
    config.vision_config.intermediate_size = 3420
    config.vision_config.fullatt_block_indexes = [7, 15, 23, 31]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".building")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.rename(out)
    return out


def write_config(folder: Path, model: Path, strategy: str, args) -> Path:
    import yaml

    world = 1 if strategy == "single" else args.gpus
    cfg = {
        "model": {"path": str(model), "dtype": "bfloat16", "gradient_checkpointing": not args.tiny},
        "data": {"train_files": [str(REPO / "datasets/shapes_demo/train.parquet")], "format": "native",
                 "min_pixels": args.image_pixels, "max_pixels": args.image_pixels, "max_prompt_length": 2048},
        "rollout": {"engine": "hf", "n": args.n, "global_batch_completions": args.prompts_per_rank * args.n * world,
                    "max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens,
                    **({"cuda_graph_decode": False} if args.eager_decode else {})},
        "reward": {"functions": [{"name": "exact_match"}]},
        "train": {"output_dir": str(folder / f"run_{strategy}"), "skip_zero_advantage_rows": False, "total_steps": args.steps, "lr": 1e-6,
                  "micro_batch_completions_per_rank": args.micro_batch, "strategy": strategy, "eval_before_training": False},
        "logging": {"tensorboard": False, "progress": False, "completions_every": 0},
    }
    path = folder / f"bench_{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def known_strategies() -> tuple[str, ...]:
    """The `train.strategy` names this checkout can run (the config accepts more names than may be built)."""
    from vlrft.parallel import strategy as module

    return tuple(getattr(module, "STRATEGIES", ("single", "ddp")))


# ------------------------------------------------------------------ one run (under torchrun or alone)


def peak_flops(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def train_flops(model, prompts: int, prompt_tokens: float, patches: float, completion_tokens: float) -> float:
    """Matmul FLOPs of one training phase: forward + backward (3 x a forward) of the work vlrft does.

    Each prompt once (its group shares it): the text layers over its tokens, the vision tower's blocks over
    its patches and the merger over patches / 4. Each completion token: the text layers and the LM head.
    Attention scores, embeddings lookups and gradient-checkpointing recomputation are left out (MFU's
    convention); the weights are read off the model (2-D weights of its linear layers). Exact for the model this
    tool builds (Qwen2.5-VL, everything trained); it would count Qwen3-VL's position-embedding table as a matmul,
    skip fused 3-D MoE experts, and count a backward for frozen weights.
    """
    from vlrft.models.actor import vision_module

    vision = vision_module(model)
    vision_ids = {id(p) for p in vision.parameters()} if vision is not None else set()
    merger = {id(p) for name, m in (vision.named_children() if vision is not None else ()) if "merger" in name
              for p in m.parameters()}
    head = model.get_output_embeddings().weight
    text = vision_block = vision_merger = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() != 2 or p is head or "embed_tokens" in name:
            continue
        if id(p) in merger:
            vision_merger += p.numel()
        elif id(p) in vision_ids:
            vision_block += p.numel()
        else:
            text += p.numel()
    forward = 2 * (text * (prompts * prompt_tokens + completion_tokens) + head.numel() * completion_tokens
                   + prompts * (vision_block * patches + vision_merger * patches / 4))
    return 3 * forward


def watch_phase_peaks(trainer):
    """Watch the peak CUDA memory allocated in each of the trainer's timed phases ("between" for the rest); returns
    a function that gives them ({phase: bytes}) so far.

    The trainer's `timer(name)` wraps each phase; here it also resets the allocator's peak on entering and leaving
    a phase, crediting the peak so far to every phase open at that moment (phases nest: the reward inside the
    generation), or to "between" when none is."""
    import contextlib

    import torch

    peaks: dict[str, int] = {}
    open_phases = ["between"]
    timer = trainer.timer

    def credit() -> None:
        reached = torch.cuda.max_memory_allocated(trainer.device)
        for name in open_phases[1:] or open_phases:  # "between" only outside every phase
            peaks[name] = max(peaks.get(name, 0), reached)
        torch.cuda.reset_peak_memory_stats(trainer.device)

    @contextlib.contextmanager
    def measured(name: str):
        credit()
        open_phases.append(name)
        try:
            with timer(name):
                yield
        finally:
            credit()
            open_phases.remove(name)

    def so_far() -> dict[str, int]:
        credit()
        return dict(peaks)

    torch.cuda.reset_peak_memory_stats(trainer.device)
    trainer.timer = measured
    return so_far


def worker(config: str, result: str) -> int:
    import resource

    import torch

    from vlrft.config import load_config
    from vlrft.plan import Hardware, plan_for_config
    from vlrft.trainer.trainer import Trainer

    cfg = load_config(config)
    trainer = Trainer(cfg)
    world = trainer.strategy.world_size
    cuda = trainer.device.type == "cuda"
    probe = trainer.encoder.encode(trainer.train_samples[:16]).batch
    prompt_tokens = sum(probe.prompt_lengths) / len(probe)
    pixels = probe.visual.pixel_values
    patches = (0 if pixels is None else pixels.shape[0]) / len(probe)  # one pixel_values row per patch
    prompts_per_step = cfg.rollout.global_batch_completions // cfg.rollout.n  # all ranks
    trained = sum(p.numel() for p in trainer.actor.parameters() if p.requires_grad)
    phase_peaks = watch_phase_peaks(trainer) if cuda else dict
    steps = []
    for i in range(cfg.train.total_steps):
        metrics = trainer.train_step()
        completion = metrics["completions/mean_length"] * cfg.rollout.global_batch_completions  # all ranks
        steps.append({"generate_s": metrics.get("time/generate", 0.0), "train_s": metrics.get("time/train", 0.0),
                      "completion_tokens": completion,
                      "train_flops": cfg.train.ppo_epochs * train_flops(
                          trainer.actor.model, prompts_per_step, prompt_tokens, patches, completion),
                      "train_tokens": cfg.train.ppo_epochs * (completion + prompt_tokens * cfg.rollout.global_batch_completions)})
    timed = steps[1:] or steps  # the first step warms up kernels and allocators
    gen_s, train_s = sum(s["generate_s"] for s in timed), sum(s["train_s"] for s in timed)
    train_tokens = sum(s["train_tokens"] for s in timed)
    phases = phase_peaks()
    peak = max(phases.values(), default=0) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = int(trainer.max_reduce(torch.tensor(float(peak))).item())
    flops = peak_flops(trainer.device)
    memory = torch.cuda.get_device_properties(trainer.device).total_memory if cuda else 80 * 2 ** 30
    plan = plan_for_config(cfg, Hardware(gpus_per_node=world, nodes=1, gpu_memory=memory))
    out = {
        "strategy": cfg.train.strategy, "world_size": world, "device": str(trainer.device),
        "device_name": torch.cuda.get_device_name(trainer.device) if cuda else "cpu",
        "parameters": plan.parameters, "trained_parameters": trained, "steps": len(steps),
        "rollout_tokens_per_s": sum(s["completion_tokens"] for s in timed) / max(gen_s, 1e-9),
        "train_tokens_per_s": train_tokens / max(train_s, 1e-9),
        "train_tflops_per_s": sum(s["train_flops"] for s in timed) / max(train_s, 1e-9) / 1e12,
        "mfu": sum(s["train_flops"] for s in timed) / train_s / (flops * world) if flops and train_s else None,
        "prompt_tokens": prompt_tokens, "patches_per_prompt": patches,
        "peak_memory_bytes": peak, "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process RSS",
        "plan_train_bytes": plan.phase_total("train"), "plan_rollout_bytes": plan.phase_total("rollout"),
        "plan_bytes": plan.total,
        # per phase of a step (the trainer's timers: time/generate, time/logprobs, time/train, ...; "between": outside
        # them), this rank's: what to set beside the plan's rollout and train figures
        "phase_peak_bytes": phases,
    }
    if trainer.strategy.is_main:
        Path(result).write_text(json.dumps(out, indent=2))
    trainer.strategy.close()
    return 0


# ------------------------------------------------------------------ the driver


def run_strategy(config: Path, strategy: str, args) -> dict | None:
    result = config.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    script = [str(Path(__file__).resolve()), "--worker", str(config), "--result", str(result)]
    if strategy == "single":
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}", *script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "VLRFT_SKIP_MEMORY_PLAN": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not result.is_file():
        print(f"{strategy}: failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    out = json.loads(result.read_text())
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def table(results: list[dict]) -> str:
    gib = 2 ** 30
    lines = [f"{'strategy':<10}{'ranks':>6}{'rollout tok/s':>15}{'train tok/s':>13}{'TFLOP/s':>9}{'MFU':>7}"
             f"{'peak/GPU':>11}{'plan train':>12}{'plan peak':>11}"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"{r['strategy']:<10}{r['world_size']:>6}{r['rollout_tokens_per_s']:>15.0f}"
                     f"{r['train_tokens_per_s']:>13.0f}{r['train_tflops_per_s']:>9.1f}{mfu:>7}{r['peak_memory_bytes'] / gib:>9.1f}Gi"
                     f"{r['plan_train_bytes'] / gib:>10.1f}Gi{r['plan_bytes'] / gib:>9.1f}Gi")
        if r.get("phase_peak_bytes"):
            lines.append("    peak by phase: " + ", ".join(f"{name} {size / gib:.1f}Gi" for name, size in
                                                         sorted(r["phase_peak_bytes"].items()))
                         + f" (plan: rollout {r['plan_rollout_bytes'] / gib:.1f}Gi, train {r['plan_train_bytes'] / gib:.1f}Gi)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", *SIZES], default="1.5b")
    parser.add_argument("--strategies", default="single,ddp,fsdp2,deepspeed")
    parser.add_argument("--gpus", type=int, default=None, help="processes for ddp/fsdp2/deepspeed (default: all GPUs)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per strategy (the first is not timed)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompts-per-rank", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512, help="tokens generated per completion")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--image-pixels", type=int, default=448 * 448)
    parser.add_argument("--out", default="runs/gpu_bench", help="folder for the model, configs and runs")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per strategy")
    parser.add_argument("--eager-decode", action="store_true",
                        help="rollout.cuda_graph_decode=false (default: CUDA graphs on a GPU)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 8 new tokens, one process")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.result)
    if args.tiny:
        args.size, args.new_tokens, args.image_pixels, args.micro_batch = "tiny", 8, 56 * 56, 8
        args.n, args.prompts_per_rank = 2, 4
        if args.strategies == parser.get_default("strategies"):
            args.strategies = "single"
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count() or 2
    folder = (REPO / args.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(folder / f"model_{args.size}", args.size)
    known = known_strategies()
    results = []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        if strategy not in known:
            print(f"{strategy}: skipped (make_strategy in this checkout knows {', '.join(known)})")
            continue
        out = run_strategy(write_config(folder, model, strategy, args), strategy, args)
        if out is not None:
            results.append(out)
    if results:
        print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())

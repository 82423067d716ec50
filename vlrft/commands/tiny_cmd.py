"""Build a tiny random-weight VLM (Qwen-VL, Qwen3-VL-MoE, GLM-4.1V, Gemma 3, InternVL 3, LLaVA-OneVision or SmolVLM)
and its processor (locally trained tokenizer) into a folder."""

import argparse
import dataclasses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlrft.models.tiny import ARCHES, TinySpec

    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--arch", choices=ARCHES, default="qwen2_vl")
    for f in dataclasses.fields(TinySpec):
        if f.type in ("int", int):
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=int, default=f.default)


def run(args: argparse.Namespace) -> int:
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    names = {f.name for f in dataclasses.fields(TinySpec)}
    spec = TinySpec(**{k: v for k, v in vars(args).items() if k in names})
    path = build_tiny_vlm(args.out_dir, spec)
    print(f"wrote a tiny {spec.arch} model and processor to {path}")
    return 0

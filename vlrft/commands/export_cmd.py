"""Merge a LoRA checkpoint into its base model and write a full Hugging Face model folder (with the processor)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", help="a LoRA run's checkpoint model folder, e.g. runs/x/checkpoints/step_50/model")
    parser.add_argument("out", help="new folder for the merged model (must not exist or be empty)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="dtype of the written weights (default auto: the base model's own, e.g. bfloat16 for "
                             "the Qwen releases, half of float32's size)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vlrft.errors import UserError
    from vlrft.models.loading import adapter_base, load_policy, load_processor, stored_dtype_name

    source, out = Path(args.adapter), Path(args.out)
    if not source.is_dir() or adapter_base(source) is None:
        raise UserError(f"'{args.adapter}' is not a LoRA adapter folder (no adapter_config.json, or it already holds a "
                        "full model with config.json); pass a LoRA run's checkpoints/step_<k>/model folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{args.out}' already exists and is not empty; pick a new folder for the merged model")
    dtype = stored_dtype_name(adapter_base(source)) if args.dtype == "auto" else args.dtype
    model = load_policy(source, dtype=dtype)
    processor = load_processor(source)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    print(f"merged '{source}' into its base '{adapter_base(source)}': full model written to {out} ({dtype})",
          flush=True)
    return 0

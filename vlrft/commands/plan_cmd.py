"""Print a config's per-GPU memory by component and whether it fits (exit 0) or not (exit 1).

    vlrft plan configs/qwen2_5_vl_7b_grpo_geometry3k.yaml --gpus 8 --gpu-memory 80GiB
    vlrft plan CONFIG --gpus 8 --nodes 2 --strategy deepspeed --zero-stage 3 --json
    vlrft plan CONFIG --gpus 8 --nodes 4 --offload --host-memory 512GiB   # the nodes' RAM checked too

Reads only the model's config.json (a local folder, a config shipped with vlrft for the Hub names of
the shipped configs, or --model-config), never the weights.
"""

from __future__ import annotations

import argparse
import json
import re

from vlrft.errors import UserError

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """'80GiB', '80GB', '141 GB', '79.6GiB' -> bytes. A bare number means GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UserError(f"plan: {option} {text!r} is not a size; write e.g. 80GiB, 80GB or 141GB")
    value = float(match.group(1))
    return int(value * (_UNITS[unit] if unit else 1 << 30))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file, e.g. configs/qwen2_5_vl_7b_grpo_geometry3k.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_completions_per_rank=2")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs per node (default 8; 1 for strategy single)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB (default), 141GB")
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp2", "deepspeed"], default=None,
                        help="plan for this train.strategy instead of the config's")
    parser.add_argument("--zero-stage", type=int, choices=[2, 3], default=None, help="DeepSpeed ZeRO stage")
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                        help="optimizer state (and ZeRO-3/FSDP2 parameters) on the CPU")
    parser.add_argument("--model-config", default=None, metavar="PATH",
                        help="the model's config.json (or its folder) when model.path is not local")
    parser.add_argument("--images-per-prompt", type=int, default=1, help="images in each prompt (default 1)")
    parser.add_argument("--videos-per-prompt", type=int, default=0,
                        help="videos in each prompt (default 0), each data.video_max_frames frames at data.max_pixels")
    parser.add_argument("--host-memory", default=None, metavar="SIZE",
                        help="RAM of one node (or its job's memory limit), e.g. 512GiB: also check the first node's "
                             "host memory (exit 1 when above it)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    from vlrft.config import load_config
    from vlrft.plan import (GiB, Hardware, format_plan, host_memory_warning, load_model_shape, plan_for_config,
                            strategy_from_config)

    cfg = load_config(args.config, args.overrides, validate=False)
    strategy = strategy_from_config(cfg, args.strategy, args.zero_stage, args.offload)
    gpus = args.gpus if args.gpus is not None else (1 if strategy.name == "single" and args.nodes == 1 else 8)
    if gpus < 1 or args.nodes < 1 or args.images_per_prompt < 0 or args.videos_per_prompt < 0:
        raise UserError("plan: --gpus and --nodes must be at least 1, --images-per-prompt and --videos-per-prompt at "
                        "least 0")
    hardware = Hardware(gpus_per_node=gpus, nodes=args.nodes, gpu_memory=parse_size(args.gpu_memory))
    if strategy.name != cfg.train.strategy:
        from dataclasses import replace

        cfg = replace(cfg, train=replace(cfg.train, strategy=strategy.name))
    if strategy.name == "single" and hardware.world_size > 1:
        raise UserError(f"plan: strategy 'single' runs one process, not {hardware.world_size}; pass --strategy ddp, "
                        "fsdp2 or deepspeed, or --gpus 1")
    cfg.validate(hardware.world_size, per_node=hardware.gpus_per_node)
    node_memory = parse_size(args.host_memory, "--host-memory") if args.host_memory is not None else None
    plan = plan_for_config(cfg, hardware, strategy, args.model_config, args.images_per_prompt,
                           args.videos_per_prompt)
    host_warning = host_memory_warning(plan, node_memory) if node_memory is not None else None
    shape = load_model_shape(cfg.model.path, args.model_config)
    if args.json:
        figures = plan.to_json()
        figures["active_parameters"] = shape.active_parameters  # a MoE model's per-token share; else all of them
        if node_memory is not None:
            figures.update(host_memory=node_memory, host_fits=host_warning is None)
        print(json.dumps(figures, indent=2))
    else:
        print(format_plan(plan))
        if shape.text.sparse_layers:  # memory holds every expert; a token's forward runs through its router's picks
            t = shape.text
            print(f"experts      {shape.active_parameters / 1e9:.3f} B of the {shape.num_parameters / 1e9:.3f} B "
                  f"parameters active per token ({t.num_experts_per_tok} of {t.num_experts} experts in "
                  f"{len(t.sparse_layers)} layers); the memory above holds all of them")
        if node_memory is not None:
            print(host_warning or f"host memory: the first node's largest phase fits in {node_memory / GiB:.1f} GiB")
        if cfg.rollout.engine == "vllm_server":  # on GPUs of their own, not counted above
            weight_bytes = (4 if cfg.model.dtype == "float32" else 2) * shape.num_parameters
            print(f"rollout servers (not on these GPUs): each holds {weight_bytes / GiB:.1f} GiB of {cfg.model.dtype} "
                  "weights (over its --tensor-parallel-size GPUs) plus the KV cache its --gpu-memory-utilization "
                  "leaves")
    return 0 if plan.fits and host_warning is None else 1

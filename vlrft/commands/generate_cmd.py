"""Answer one prompt (with optional images) with a model folder: a quick check of a checkpoint."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder (save_pretrained layout, with its processor), a LoRA checkpoint's "
                                      "model/ folder (merged into its base), or a Hub id")
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--image", action="append", default=[], help="image file; repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from vlrft.config import DataConfig
    from vlrft.data.media import MediaError, MediaLimits, load_image, not_a_file_reason
    from vlrft.errors import UserError
    from vlrft.models.loading import load_policy, load_processor

    limits = MediaLimits(DataConfig.max_source_pixels, DataConfig.max_aspect_ratio)
    images = []
    for path in args.image:  # checked before the model loads: same decoding and limits as training
        if not Path(path).is_file():
            raise UserError(f"--image: {not_a_file_reason(Path(path), 'image')}")
        try:
            images.append(load_image(path, limits))
        except MediaError as exc:
            raise UserError(f"--image '{path}': {exc}") from None
    processor = load_processor(args.model)
    model = load_policy(args.model).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    torch.manual_seed(args.seed)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, **sampling)
    completion = out[0, inputs["input_ids"].shape[1]:]
    print(processor.tokenizer.decode(completion, skip_special_tokens=True))
    return 0

"""A run's samples, read and checked before any model loads (`data.train_files`, `data.eval_files`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from vlrft.config import DataConfig
from vlrft.data import read_samples
from vlrft.errors import UserError


def read_training_data(files: list[str], limit: int | None, key: str, data: DataConfig, strategy,
                       message: Callable[[str], None], progress: bool = False) -> list:
    """The samples of `files` (at most `limit`), bad ones refused or left out as `data.on_bad_sample` says."""
    samples = []
    for path in files:
        left = limit - len(samples) if limit else None  # max_*_samples: reading stops there
        if left is not None and left <= 0:
            break
        samples.extend(read_samples(path, data.format, data.image_root, data.on_bad_sample, limit=left))
    if not samples:
        raise UserError(f"config: {key}={files!r} holds no samples; list JSONL/parquet/HF-dataset files "
                        "(check them with `vlrft data check FILE`)")
    return without_bad_samples(samples, key, data, strategy, message, progress) if data.validate_media else samples


def without_bad_samples(samples: list, key: str, data: DataConfig, strategy, message: Callable[[str], None],
                        progress: bool = False) -> list:
    """Check every prompt and decode every image up front (cached, parallel), before any model loads, so a bad
    sample stops the run now and not at the step that draws it; honour data.on_bad_sample.

    Every rank checks its share (every world_size-th sample) and the problems are gathered: on 64 ranks and
    millions of images the check takes 1/64 of the time one rank would, well inside the collective timeout
    the other ranks would otherwise wait under."""
    from vlrft.data.media import MediaLimits
    from vlrft.data.validate import find_bad_media, find_bad_prompts

    rank, world = strategy.rank, strategy.world_size
    share = samples[rank::world]
    mine = find_bad_prompts(share, data.system_prompt, data.prompt_suffix, data.special_tokens_in_text)
    mine += find_bad_media(share, MediaLimits(data.max_source_pixels, data.max_aspect_ratio), progress=progress)
    mine = [dataclasses.replace(p, index=rank + p.index * world) for p in mine]  # indices into `samples`
    problems = sorted((p for part in strategy.all_gather_object(mine) for p in part), key=lambda p: p.index)
    if not problems:
        return samples
    bad = {p.index for p in problems}
    if data.on_bad_sample == "error":
        raise UserError(f"{key}: {len(bad)} of {len(samples)} samples are unusable, first: {problems[0]}; "
                        "fix them or set data.on_bad_sample=skip (`vlrft data check FILE` lists every one)")
    message(f"{key}: left out {len(bad)} of {len(samples)} unusable samples (data.on_bad_sample=skip), first: "
            f"{problems[0]}")
    kept = [sample for i, sample in enumerate(samples) if i not in bad]
    if not kept:
        raise UserError(f"{key}: no sample is usable; check the files with `vlrft data check FILE`")
    return kept

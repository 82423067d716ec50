"""A run's samples, read and checked before any model loads (`data.train_files`, `data.eval_files`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from vlrft.config import Config, DataConfig
from vlrft.data import read_samples
from vlrft.data.validate import MediaProblem
from vlrft.errors import UserError


def read_training_data(files: list[str], limit: int | None, key: str, cfg: Config, strategy,
                       message: Callable[[str], None], progress: bool = False) -> list:
    """The samples of `files` (at most `limit`), bad ones (and ones `rollout.engine` cannot take) refused or left out
    as `data.on_bad_sample` says."""
    data = cfg.data
    samples = []
    for path in files:
        left = limit - len(samples) if limit else None  # max_*_samples: reading stops there
        if left is not None and left <= 0:
            break
        samples.extend(read_samples(path, data.format, data.image_root, data.on_bad_sample, limit=left))
    if not samples:
        raise UserError(f"config: {key}={files!r} holds no samples; list JSONL/parquet/HF-dataset files "
                        "(check them with `vlrft data check FILE`)")
    if data.validate_media:
        samples = without_bad_samples(samples, key, data, strategy, message, progress)
    return without_videos_the_model_refuses(without_engine_refusals(samples, key, cfg, message), key, cfg, message)


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
    return _leave_out(samples, problems, key, data.on_bad_sample, message, ("are unusable", "unusable samples"),
                      "fix them or set data.on_bad_sample=skip (`vlrft data check FILE` lists every one)")


def without_engine_refusals(samples: list, key: str, cfg: Config, message: Callable[[str], None]) -> list:
    """Samples `rollout.engine` cannot take for this model (`prompt_refusal`: a LLaVA-OneVision prompt with several
    images on vLLM) refused, or left out with data.on_bad_sample=skip, when the data is read: not at the step that
    draws one, after steps already trained."""
    from vlrft.rollout.requests import VLLM_PROCESSOR_ENGINES, prompt_refusal

    engine = cfg.rollout.engine
    model_type = _model_type(cfg) if engine in VLLM_PROCESSOR_ENGINES and any(len(s.images) > 1 for s in samples) \
        else None
    if model_type is None:
        return samples
    problems = [MediaProblem(i, f"{s.source} (id {s.id!r})", "images", why) for i, s in enumerate(samples)
                if (why := prompt_refusal(engine, model_type, len(s.images)))]
    return _leave_out(samples, problems, key, cfg.data.on_bad_sample, message,
                      (f"are refused by rollout.engine={engine}", f"samples rollout.engine={engine} cannot take"),
                      "or set data.on_bad_sample=skip to leave them out")


def without_videos_the_model_refuses(samples: list, key: str, cfg: Config, message: Callable[[str], None]) -> list:
    """Samples with videos, for a family vlrft trains on images only (the family table's video cell, with its
    reason), refused or left out with data.on_bad_sample=skip when the data is read, before any model loads."""
    from vlrft.families import family

    if not any(s.videos for s in samples):
        return samples
    model_type = _model_type(cfg)
    fam = family(model_type) if model_type else None
    if fam is None or fam.video.supported:
        return samples
    why = f"{fam.name} ({model_type}) takes no videos in vlrft yet: {fam.video.refused}"
    problems = [MediaProblem(i, f"{s.source} (id {s.id!r})", "videos", why) for i, s in enumerate(samples) if s.videos]
    return _leave_out(samples, problems, key, cfg.data.on_bad_sample, message,
                      (f"have videos, which {fam.name} is not trained with", f"samples with videos {fam.name} refuses"),
                      "use images (e.g. sampled frames as several <image> parts) or a Qwen-VL model; or set "
                      "data.on_bad_sample=skip to leave them out")


def _model_type(cfg: Config) -> str | None:
    """model.path's family, or None where it cannot be read yet (a model.build_recipe builds it later; the engine
    refuses such prompts when they are drawn)."""
    from vlrft.models.loading import model_type_of

    if cfg.model.build_recipe and not Path(cfg.model.path).exists():
        return None
    try:
        return model_type_of(cfg.model.path)
    except (OSError, ValueError):  # a Hub id not reachable now: the model load names it
        return None


def _leave_out(samples: list, problems: list[MediaProblem], key: str, on_bad_sample: str,
               message: Callable[[str], None], what: tuple[str, str], fix: str) -> list:
    """`samples` without the ones `problems` name (data.on_bad_sample=skip, said in one line), or a `UserError`.
    `what`: how the error and the message say what they are ("are unusable", "unusable samples")."""
    if not problems:
        return samples
    bad = {p.index for p in problems}
    if on_bad_sample == "error":
        raise UserError(f"{key}: {len(bad)} of {len(samples)} samples {what[0]}, first: {problems[0]}; {fix}")
    message(f"{key}: left out {len(bad)} of {len(samples)} {what[1]} (data.on_bad_sample=skip), first: {problems[0]}")
    kept = [sample for i, sample in enumerate(samples) if i not in bad]
    if not kept:
        raise UserError(f"{key}: no sample is left: all {len(samples)} are {what[1]}, first: {problems[0]}")
    return kept

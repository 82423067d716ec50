"""`vlrft data check`: find every bad row of a dataset before training, and summarise the good ones.

Bad rows: unreadable rows, missing or unreadable images/videos, placeholder count != media count,
empty prompt, missing answer, reserved or chat special tokens in the text (data.special_tokens_in_text:
the model's own with a processor, common templates' without), and (with a processor) prompts longer
than `data.max_prompt_length` with their token count. Prompt lengths are in tokens (vision tokens
included) when a processor is given, in characters otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from vlrft.config import DataConfig
from vlrft.data.media import MediaError, MediaLimits, load_image, load_video, open_image_source
from vlrft.data.readers import read_dataset
from vlrft.data.sample import (BadSampleError, Sample, SkippedSample, build_messages, special_token_error,
                               special_tokens_in)

PERCENTILES = (50, 90, 99)
# How images of unusual PIL modes become the RGB the model sees (vlrft.data.media.to_rgb).
MODE_NOTES = {**{m: " (16-bit, scaled to 8 bits)" for m in ("I;16", "I;16L", "I;16B", "I;16N")},
              "I": " (32-bit integer, scaled to 8 bits by its value range)",
              "F": " (float, scaled to 8 bits by its value range)",
              **{m: " (transparency composited over white)" for m in ("RGBA", "RGBa", "LA", "La", "PA")},
              "CMYK": " (converted to RGB)", "1": " (1-bit, black and white)"}


@dataclass
class CheckReport:
    """What `check_dataset` found in one file."""

    path: str
    layout: str
    rows: int = 0
    bad: list[SkippedSample] = field(default_factory=list)
    images_per_row: Counter = field(default_factory=Counter)
    videos_per_row: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)
    image_modes: Counter = field(default_factory=Counter)  # PIL mode of each readable image
    prompt_lengths: list[int] = field(default_factory=list)
    length_unit: str = "characters"
    max_prompt_length: int | None = None

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def bad_rows(self) -> int:
        return len({b.source for b in self.bad})

    def summary(self) -> str:
        """Human-readable report: one line per problem, then the summary."""
        lines = [f"BAD {b}" for b in sorted(self.bad, key=_row_order)]
        lines.append(f"{self.path} ({self.layout} layout): {self.rows} rows, {self.rows - self.bad_rows} good, "
                     f"{self.bad_rows} bad")
        lines.append("  images per row: " + _histogram(self.images_per_row))
        lines.append("  videos per row: " + _histogram(self.videos_per_row))
        if self.image_modes:
            lines.append("  image modes: " + ", ".join(f"{mode}: {n}{MODE_NOTES.get(mode, '')}"
                                                      for mode, n in sorted(self.image_modes.items())))
        if self.labels:
            lines.append("  labels: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.labels.items(), key=str)))
        if self.prompt_lengths:
            lengths = np.asarray(self.prompt_lengths)
            stats = ", ".join(f"p{p} {int(np.percentile(lengths, p))}" for p in PERCENTILES)
            limit = f" (limit {self.max_prompt_length})" if self.max_prompt_length and self.length_unit == "tokens" else ""
            unit = "tokens incl. vision tokens" if self.length_unit == "tokens" else "characters; pass --model for tokens"
            lines.append(f"  prompt length ({unit}): min {lengths.min()}, {stats}, max {lengths.max()}{limit}")
        return "\n".join(lines)


def _row_order(bad: SkippedSample) -> tuple:
    numbers = re.findall(r"\d+", bad.source)
    return (bad.source.split(" ")[0], int(numbers[-1]) if numbers else 0, bad.field)


def _histogram(counter: Counter) -> str:
    return ", ".join(f"{k}: {v} rows" for k, v in sorted(counter.items())) or "none"


def _bad(sample: Sample, field_name: str, reason: str) -> SkippedSample:
    return SkippedSample(sample, sample.source, field_name, reason)


def _check_media(sample: Sample, cfg: DataConfig) -> list[SkippedSample]:
    limits = MediaLimits(cfg.max_source_pixels, cfg.max_aspect_ratio)
    problems = []
    for k, ref in enumerate(sample.images):
        try:
            load_image(ref, limits)
        except MediaError as exc:
            problems.append(_bad(sample, f"images[{k}]", str(exc)))
    for k, ref in enumerate(sample.videos):
        try:
            load_video(ref, cfg.video_fps, cfg.video_max_frames, limits=limits)
        except MediaError as exc:
            problems.append(_bad(sample, f"videos[{k}]", str(exc)))
    return problems


def _mode_of(ref: Any) -> list[str]:
    """[the PIL mode of an image reference] from its header, or [] when unreadable (reported elsewhere)."""
    try:
        image = open_image_source(ref)
    except MediaError:
        return []
    mode = image.mode
    given = ref.values() if isinstance(ref, dict) else [ref]
    if not any(isinstance(v, Image.Image) for v in given):
        image.close()  # opened here for its header only
    return [mode]


def _prompt_chars(messages: list[dict]) -> int:
    return sum(len(p["text"]) for m in messages for p in m["content"] if p["type"] == "text")


def check_dataset(path: str, cfg: DataConfig, processor: Any = None, require_answer: bool = True,
                  batch_size: int = 16) -> CheckReport:
    """Read and check one dataset with the settings of `cfg` (format, image_root, pixels, max length)."""
    read = read_dataset(path, cfg.format, cfg.image_root, on_bad_sample="skip")
    report = CheckReport(path=str(path), layout=next(iter(read.formats.values()), cfg.format), rows=read.rows,
                         bad=list(read.skipped), max_prompt_length=cfg.max_prompt_length)
    for sample in read.samples:
        report.images_per_row[len(sample.images)] += 1
        report.videos_per_row[len(sample.videos)] += 1
        if sample.label is not None:
            report.labels[sample.label] += 1
        for ref in sample.images:
            report.image_modes.update(_mode_of(ref))
        if require_answer and (sample.answer is None or not str(sample.answer).strip()):
            report.bad.append(_bad(sample, "answer", "no reference answer; add one (or pass --allow-missing-answer "
                                                     "when rewards do not need it)"))
    if processor is None:
        for sample in read.samples:
            try:
                messages = build_messages(sample, cfg.system_prompt, cfg.prompt_suffix)
                found = special_tokens_in(sample) if cfg.special_tokens_in_text == "refuse" else []
                if found:  # common templates' tokens; with --model, the model's own (PromptEncoder)
                    raise special_token_error(sample, found)
            except BadSampleError as exc:
                report.bad.append(SkippedSample.from_error(exc, sample))
                continue
            problems = _check_media(sample, cfg)
            report.bad.extend(problems)
            if not problems:
                report.prompt_lengths.append(_prompt_chars(messages))
        return report
    _check_with_processor(read.samples, cfg, processor, report, batch_size)
    return report


def _check_with_processor(samples: Sequence[Sample], cfg: DataConfig, processor: Any, report: CheckReport,
                          batch_size: int) -> None:
    from vlrft.data.processor import PromptEncoder, too_long_reason

    # Encode without a length limit so every prompt's length is known; the limit is applied here.
    encoder = PromptEncoder(processor, dataclasses.replace(cfg, on_bad_sample="skip", max_prompt_length=2**62))
    report.length_unit = "tokens"
    for start in range(0, len(samples), batch_size):
        result = encoder.encode(samples[start:start + batch_size])
        report.bad.extend(result.skipped)
        batch = result.batch
        vision = [a + b for a, b in zip(batch.visual.image_tokens_per_sample(), batch.visual.video_tokens_per_sample())]
        for sample, n_tokens, n_vision in zip(batch.samples, batch.prompt_lengths, vision):
            report.prompt_lengths.append(n_tokens)
            if n_tokens > cfg.max_prompt_length:
                report.bad.append(_bad(sample, "prompt", too_long_reason(n_tokens, n_vision, cfg.max_prompt_length)))

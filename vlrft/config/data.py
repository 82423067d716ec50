"""The `data:` section: training and evaluation files, prompt length and the media bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlrft.config.options import option


@dataclass
class DataConfig:
    """Training and evaluation data, and how images, videos and prompts are prepared."""

    train_files: list[str] = option(help="training data files (JSONL, JSON, Parquet, CSV); see data.format",
                                    factory=list)
    eval_files: list[str] = option(help="evaluation data files, same formats; empty = no evaluation", factory=list)
    format: Literal["auto", "native", "easyr1", "verl", "trl", "openrlhf"] = option(
        "auto", "field layout of the data files; 'auto' recognises each of the others from the columns")
    image_root: str | None = option(None, "relative image paths resolve against this folder (default: the data "
                                    "file's folder); absolute paths and symlinks are followed wherever they point "
                                    "(docs/design.md, Media paths)")
    system_prompt: str | None = option(None, "system message put before every prompt; null = none")
    prompt_suffix: str | None = option(None, "text appended to every user prompt, e.g. an answer-format "
                                       "instruction")
    max_prompt_length: int = option(1024, "tokens, vision tokens included; a longer prompt is an error or a skip "
                                    "(data.on_bad_sample)", minimum=1)
    min_pixels: int = option(28 * 28 * 4, "images smaller than this (width*height) are scaled up to it before "
                             "patching (fewer vision tokens: lower it)", minimum=1)
    max_pixels: int = option(28 * 28 * 1024, "images larger than this (width*height) are scaled down to it; the "
                             "main knob for vision tokens per image", minimum=1)
    video_fps: float = option(2.0, "frames sampled per second of video")
    video_max_frames: int = option(32, "at most this many frames per video", minimum=1)
    on_bad_sample: Literal["error", "skip"] = option(
        "error", "an unreadable or over-long sample: 'error' stops with its id, 'skip' drops it and counts it")
    special_tokens_in_text: Literal["refuse", "escape"] = option(
        "refuse", "a chat special token (e.g. <|im_end|>, <|im_start|>) written literally in a sample's text would be "
        "read as chat markup (a forged assistant turn): 'refuse' makes the sample bad (data.on_bad_sample), naming "
        "it and the token; 'escape' breaks each with a zero-width space (U+200B) after its first character so the "
        "tokenizer reads it as plain text")
    validate_media: bool = option(True, "before training, check every prompt, decode every image once and open "
                                  "every video file (cached by file fingerprint; each rank checks its share); bad "
                                  "ones are errors or skips per data.on_bad_sample")
    max_source_pixels: int = option(89_478_485, "images larger than this (width*height) are refused before "
                                    "decoding (decompression bombs)", minimum=1)
    max_aspect_ratio: float = option(200.0, "images longer than this ratio are refused (Qwen-VL cannot patch them)")
    shuffle: bool = option(True, "shuffle the training prompts each epoch (seeded by train.seed)")
    max_train_samples: int | None = option(None, "use only the first N training samples; null = all", minimum=1)
    max_eval_samples: int | None = option(None, "use only the first N evaluation samples; null = all", minimum=1)


"""Turn samples into model-ready prompts: chat template, media, ONE processor call per batch of prompts.

`PromptEncoder.encode` processes each prompt once, however many completions will be sampled from
it; the group shares the prompt's ids and pixels by index (`PromptBatch.select` / `VisualBatch.select`).
The prompt ids it returns are exactly what every rollout engine receives and what training sees:
nothing downstream re-tokenizes. An over-long prompt is never truncated (cutting through vision
tokens desynchronises ids and pixels): it raises, or is a counted skip with `data.on_bad_sample=skip`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vlrft.config import DataConfig
from vlrft.data.media import (LoadedVideo, MediaError, MediaLimits, PixelBounds, fit_image, load_image, load_video,
                              uniform_frames)
from vlrft.data.sample import (BadSampleError, Sample, SkippedSample, build_messages, escape_special_tokens,
                               reserved_tokens_in, special_token_error, special_tokens_in)
from vlrft.errors import UserError
from vlrft.families import FAMILIES
from vlrft.vision import CROP_PROCESSORS, VisualBatch, crop_rows

logger = logging.getLogger(__name__)


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad unequal prompts into `(input_ids, attention_mask)`, both `[batch, max_len]` long tensors."""
    if not prompt_ids:
        return torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long)
    rows = [torch.as_tensor(ids, dtype=torch.long) for ids in prompt_ids]
    input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left")
    ones = [torch.ones(len(r), dtype=torch.long) for r in rows]
    mask = torch.nn.utils.rnn.pad_sequence(ones, batch_first=True, padding_value=0, padding_side="left")
    return input_ids, mask


@dataclass
class PromptBatch:
    """One entry per prompt (never repeated per completion): ids, chat text, loaded media, visual tensors."""

    samples: list[Sample]
    prompt_ids: list[list[int]]  # exact processor output (chat template + expanded vision tokens), unpadded
    prompt_texts: list[str]  # the chat-templated text, before vision-token expansion
    images: list[list[Any]]  # PIL images per prompt, exactly as processed (rewards, vLLM multi_modal_data)
    videos: list[list[LoadedVideo]]  # sampled frames + metadata per prompt
    visual: VisualBatch

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]

    def select(self, indices: Sequence[int]) -> "PromptBatch":
        """The prompts at `indices` (order kept, repeats allowed); visual tensors are sliced, not re-processed."""
        idx = [int(i) for i in indices]
        return PromptBatch(
            samples=[self.samples[i] for i in idx],
            prompt_ids=[self.prompt_ids[i] for i in idx],
            prompt_texts=[self.prompt_texts[i] for i in idx],
            images=[self.images[i] for i in idx],
            videos=[self.videos[i] for i in idx],
            visual=self.visual.select(idx),
        )

    @classmethod
    def concat(cls, batches: Sequence["PromptBatch"]) -> "PromptBatch":
        """Prompts of all batches in order (e.g. refilling a step with freshly encoded prompts)."""
        if not batches:
            raise ValueError("PromptBatch.concat needs at least one batch")
        return cls(
            samples=[s for b in batches for s in b.samples],
            prompt_ids=[ids for b in batches for ids in b.prompt_ids],
            prompt_texts=[t for b in batches for t in b.prompt_texts],
            images=[im for b in batches for im in b.images],
            videos=[v for b in batches for v in b.videos],
            visual=VisualBatch.concat([b.visual for b in batches]),
        )

    def left_pad(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)` of the prompts, left-padded with `pad_id`."""
        return left_pad(self.prompt_ids, pad_id)


@dataclass
class EncodeResult:
    """The encoded prompts and the samples left out (only with `data.on_bad_sample=skip`), for the logs."""

    batch: PromptBatch
    skipped: list[SkippedSample] = field(default_factory=list)


@dataclass
class _Prepared:
    sample: Sample
    messages: list[dict]
    images: list[Any]
    videos: list[LoadedVideo]


def _size_bound(size: Any, *names: str) -> int | None:
    for name in names:
        value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
        if value:
            return int(value)
    return None


# Image processors whose resize bounds count an image's temporal frames: GLM-4.1V's smart_resize compares
# t * h * w (t = temporal_patch_size for an image) with size's shortest/longest edge, where Qwen's compares h * w.
FRAME_COUNTING_BOUNDS = ("Glm4vImageProcessor", "Glm4vImageProcessorPil")
# Processors that take a batch's images as one list per prompt (Gemma 3's checks each prompt's count), not one list.
NESTED_IMAGES = ("Gemma3Processor", "LlavaOnevisionProcessor",  # LLaVA-OV: a multi-image prompt's are not cropped
                 "SmolVLMProcessor")
# Processors whose videos vlrft does not encode yet, with the reason (the family named for the user): the family
# table's (`vlrft.families`) refused video cells.
VIDEO_UNSUPPORTED = {f.processor: f"{f.name}: {f.video.refused}" for f in FAMILIES if not f.video.supported}
# Processors whose videos all need one frame count (LLaVA-OneVision: its forward takes a batch's videos as one
# [videos, frames, ...] tensor): each video becomes data.video_max_frames frames spread evenly over those sampled.
FIXED_FRAMES = ("LlavaOnevisionProcessor",)


def _pixel_bounds(sub_processor: Any, cfg: DataConfig) -> PixelBounds | None:
    """The config's pixel bounds intersected with the processor's own, on the processor's patch grid.

    Images fitted to these bounds pass through the processor's resize unchanged, so any engine that
    runs the same processor on `PromptBatch.images` gets exactly our pixels and grids.
    """
    patch = getattr(sub_processor, "patch_size", None)
    merge = getattr(sub_processor, "merge_size", None)
    if not patch or not merge:
        return None  # not a patch-grid processor: it resizes on its own
    size = getattr(sub_processor, "size", None) or {}
    frames = int(getattr(sub_processor, "temporal_patch_size", 1) or 1) \
        if type(sub_processor).__name__ in FRAME_COUNTING_BOUNDS else 1
    own_low = (_size_bound(size, "shortest_edge", "min_pixels") or 0) // frames
    own_high = (_size_bound(size, "longest_edge", "max_pixels") or cfg.max_pixels * frames) // frames
    low = max(cfg.min_pixels, own_low, getattr(sub_processor, "min_pixels", None) or 0)
    high = min(cfg.max_pixels, own_high, getattr(sub_processor, "max_pixels", None) or cfg.max_pixels)
    return PixelBounds(factor=int(patch) * int(merge), min_pixels=min(low, high), max_pixels=high)


class PromptEncoder:
    """Encodes batches of samples with a Hugging Face multimodal processor; see the module docstring."""

    def __init__(self, processor: Any, cfg: DataConfig, extra_eos_token_ids: Sequence[int] = ()):
        self.processor = processor
        self.cfg = cfg
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if not (getattr(processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)):
            raise UserError("the model's processor has no chat template; use an instruct/chat checkpoint, or copy "
                            "chat_template.jinja from the base model into the model folder")
        self._image_processor = getattr(processor, "image_processor", None)
        self._video_processor = getattr(processor, "video_processor", None)
        self._image_bounds = _pixel_bounds(self._image_processor, cfg) if self._image_processor else None
        self._video_bounds = _pixel_bounds(self._video_processor, cfg) if self._video_processor else None
        self._limits = MediaLimits(cfg.max_source_pixels, cfg.max_aspect_ratio)
        self._extra_eos = tuple(int(t) for t in extra_eos_token_ids)
        mm_tokens = {getattr(processor, "image_token", None), getattr(processor, "video_token", None)}
        special = getattr(self.tokenizer, "all_special_tokens", [])
        mm_tokens |= {t for t in special if any(word in t for word in ("vision", "image", "video"))}
        self._reserved = sorted(t for t in mm_tokens if t)
        # Every token the tokenizer reads as markup when written in text (data.special_tokens_in_text); longest first,
        # so an escape breaks a token before any shorter one inside it.
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        special = {*special, *self._reserved, *(t.content for t in added.values() if getattr(t, "special", False))}
        self._special = sorted((t for t in special if isinstance(t, str) and t), key=lambda t: (-len(t), t))
        # Multi-turn tools (vlrft.rollout.multiturn.install_tool_prompt): schemas the chat template renders, or a
        # system text describing them for templates without tool support.
        self.tools: list[dict] | None = None
        self.tool_prompt: str | None = None

    def image_bounds(self, max_pixels: int = 0) -> PixelBounds | None:
        """Pixel bounds of images: the prompts' (`data.min/max_pixels`), or with another `max_pixels` (tool images,
        `rollout.tool_image_max_pixels`), always within the processor's own bounds."""
        if not max_pixels or self._image_processor is None:
            return self._image_bounds
        return _pixel_bounds(self._image_processor, replace(self.cfg, max_pixels=max_pixels))

    # ------------------------------------------------------------------ token ids

    def _token_id(self, attr: str, token_attr: str) -> int | None:
        value = getattr(self.processor, attr, None)
        if value is not None:
            return int(value)
        token = getattr(self.processor, token_attr, None)
        return None if token is None else int(self.tokenizer.convert_tokens_to_ids(token))

    @property
    def image_token_id(self) -> int | None:
        return self._token_id("image_token_id", "image_token")

    @property
    def video_token_id(self) -> int | None:
        return self._token_id("video_token_id", "video_token")

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS plus any passed in (e.g. the model's generation_config.eos_token_id)."""
        ids = [self.tokenizer.eos_token_id, *self._extra_eos]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    @property
    def merge_size(self) -> int:
        """Patches merged per side into one token (from the processor; 1 for processors without merging)."""
        return int(getattr(self._image_processor, "merge_size", None) or 1)

    @property
    def tile_tokens(self) -> int:
        """Prompt tokens per image tile for processors that split images into tiles (SmolVLM's image_seq_len)."""
        return int(getattr(self.processor, "image_seq_len", 0) or 0)

    # ------------------------------------------------------------------ encoding

    def encode(self, samples: Sequence[Sample]) -> EncodeResult:
        """Encode `samples` into one `PromptBatch` (one processor call); bad samples raise or are skipped."""
        prepared: list[_Prepared] = []
        skipped: list[SkippedSample] = []
        for sample in samples:
            try:
                prepared.append(self._prepare(sample))
            except BadSampleError as exc:
                self._reject(exc, sample, skipped)
        outputs, prepared = self._process(prepared, skipped)
        if not prepared:
            return EncodeResult(self._empty_batch(), skipped)
        texts, out = outputs
        prompt_ids = [list(ids) for ids in out["input_ids"]]
        images_per_sample = [len(p.images) for p in prepared]
        videos_per_sample = [len(p.videos) for p in prepared]
        visual = VisualBatch.from_processor_output(crop_rows(self.processor, out, images_per_sample),
                                                   images_per_sample, videos_per_sample, self.merge_size,
                                                   self.tile_tokens)
        keep = []
        for i, p in enumerate(prepared):
            try:
                self._check_length(p.sample, prompt_ids[i], visual, i)
                keep.append(i)
            except BadSampleError as exc:
                self._reject(exc, p.sample, skipped)
        if len(keep) < len(prepared):
            visual = visual.select(keep)
            prepared = [prepared[i] for i in keep]
            prompt_ids = [prompt_ids[i] for i in keep]
            texts = [texts[i] for i in keep]
        # (crops, LLaVA-OV's pooled frames: a token count is not a multiple of pixel rows; the processor wrote both)
        if self.image_token_id is not None and self.video_token_id is not None and \
                type(self.processor).__name__ not in CROP_PROCESSORS:
            visual.check(prompt_ids, self.image_token_id, self.video_token_id,
                         [f"{p.sample.source} (id {p.sample.id!r})" for p in prepared])
        batch = PromptBatch(
            samples=[p.sample for p in prepared],
            prompt_ids=prompt_ids,
            prompt_texts=list(texts),
            images=[p.images for p in prepared],
            videos=[p.videos for p in prepared],
            visual=visual,
        )
        return EncodeResult(batch, skipped)

    def _empty_batch(self) -> PromptBatch:
        return PromptBatch([], [], [], [], [], VisualBatch.empty(0, self.merge_size))

    def _reject(self, exc: BadSampleError, sample: Sample, skipped: list[SkippedSample]) -> None:
        if self.cfg.on_bad_sample != "skip":
            raise exc
        logger.warning("skipping bad sample: %s", exc)
        skipped.append(SkippedSample.from_error(exc, sample))

    def _prepare(self, sample: Sample) -> _Prepared:
        """Messages and loaded media of one sample; raises BadSampleError naming the field."""
        system = "\n\n".join(t for t in (self.cfg.system_prompt, self.tool_prompt) if t) or None
        messages = build_messages(sample, system, self.cfg.prompt_suffix)
        escape = self.cfg.special_tokens_in_text == "escape"
        reserved = reserved_tokens_in(messages, self._reserved)
        if reserved and not escape:
            raise BadSampleError(sample.source, sample.id, "prompt",
                                 f"the text contains the reserved token(s) {reserved}; the processor inserts those "
                                 "itself, write <image> / <video> placeholders instead")
        found = special_tokens_in(sample, self._special)
        if found and not escape:
            raise special_token_error(sample, found)
        if found:
            messages = escape_special_tokens(messages, [t for t in self._special if t in {tok for _, tok in found}])
        if sample.videos:
            self._require_video()
        images = []
        for k, ref in enumerate(sample.images):
            try:
                images.append(fit_image(load_image(ref, self._limits), self._image_bounds))
            except MediaError as exc:
                raise BadSampleError(sample.source, sample.id, f"images[{k}]", str(exc)) from None
        videos = []
        frame_factor = int(getattr(self._video_processor, "temporal_patch_size", 1) or 1)
        for k, ref in enumerate(sample.videos):
            try:
                video = load_video(ref, self.cfg.video_fps, self.cfg.video_max_frames, frame_factor,
                                   self._video_bounds, self._limits)
                fixed = type(self.processor).__name__ in FIXED_FRAMES
                videos.append(uniform_frames(video, self.cfg.video_max_frames) if fixed else video)
            except MediaError as exc:
                raise BadSampleError(sample.source, sample.id, f"videos[{k}]", str(exc)) from None
        return _Prepared(sample, messages, images, videos)

    def _require_video(self) -> None:
        family = VIDEO_UNSUPPORTED.get(type(self.processor).__name__)
        if family is not None:
            raise UserError(f"the data has videos, which vlrft does not train with this model yet ({family}); "
                            "use images (e.g. sampled frames as several <image> parts) or a Qwen-VL model")
        if self._video_processor is None:
            from vlrft.vision_stack import has_torchvision, require_video_support

            if not has_torchvision():
                require_video_support("a sample with a video")
            raise UserError("the data has videos but this model's processor has no video processor; use a "
                            "video-capable model (e.g. Qwen2.5-VL) or drop the videos")

    def _call_processor(self, prepared: list[_Prepared]) -> tuple[list[str], Any]:
        tools = {"tools": self.tools} if self.tools else {}
        texts = self.processor.apply_chat_template([p.messages for p in prepared], tokenize=False,
                                                   add_generation_prompt=True, **tools)
        images: list = [im for p in prepared for im in p.images]
        if type(self.processor).__name__ in NESTED_IMAGES and images:
            images = [list(p.images) for p in prepared]
        videos = [v for p in prepared for v in p.videos]
        kwargs: dict[str, Any] = {}
        if videos:
            # Frames are already sampled (fps, max frames); metadata carries the timing M-RoPE needs.
            kwargs.update(videos=[v.frames for v in videos], video_metadata=[v.metadata for v in videos],
                          do_sample_frames=False)
        bos = getattr(self.processor.tokenizer, "bos_token", None)
        if bos and all(t.startswith(bos) for t in texts):
            # The chat template wrote the BOS (Gemma 3's): a tokenizer that adds one too (Gemma's does) must not, or
            # every prompt starts <bos><bos>; transformers' own chat path tokenizes without special tokens likewise
            kwargs["add_special_tokens"] = False
        out = self.processor(text=list(texts), images=images or None, return_tensors=None, **kwargs)
        return list(texts), out

    def _process(self, prepared: list[_Prepared], skipped: list[SkippedSample]):
        """One processor call for the batch; if it fails, find the failing samples one by one."""
        if not prepared:
            return None, prepared
        try:
            return self._call_processor(prepared), prepared
        except UserError:
            raise
        except Exception as batch_error:
            if len(prepared) == 1:
                p = prepared[0]
                self._reject(BadSampleError(p.sample.source, p.sample.id, "prompt",
                                            f"the processor failed on this sample: {type(batch_error).__name__}: "
                                            f"{batch_error}"), p.sample, skipped)
                return None, []
            good = []
            for p in prepared:
                _, ok = self._process([p], skipped)
                good += ok
            if len(good) == len(prepared):
                raise batch_error  # no sample fails alone: a bug, not bad data
            return self._process(good, skipped)

    def _check_length(self, sample: Sample, ids: list[int], visual: VisualBatch, index: int) -> None:
        limit = self.cfg.max_prompt_length
        if len(ids) > limit:
            vision = visual.image_tokens_per_sample()[index] + visual.video_tokens_per_sample()[index]
            raise BadSampleError(sample.source, sample.id, "prompt", too_long_reason(len(ids), vision, limit))


def too_long_reason(num_tokens: int, vision_tokens: int, limit: int) -> str:
    """Why an over-long prompt is refused, and the fixes."""
    return (f"the prompt is {num_tokens} tokens ({vision_tokens} of them vision tokens), over "
            f"data.max_prompt_length={limit}; prompts are never truncated: raise data.max_prompt_length, lower "
            "data.max_pixels / data.video_max_frames, or set data.on_bad_sample=skip")

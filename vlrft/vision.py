"""The one place that knows how visual tensors are laid out (docs/design.md, "Visual tensors").

Qwen-VL processors flatten every patch of every image in a batch into one `pixel_values` tensor of
shape `[sum_i t_i*h_i*w_i, D]`, with `image_grid_thw` `[num_images, 3]` (videos likewise).
`VisualBatch` keeps those tensors together with how many images/videos each sample owns, so a
micro-batch, a group repeat or a concatenation is pure row slicing by cumulative `prod(thw)`.
Keys of other model families plug in through `SLICING_RULES` (how dim 0 of a key is indexed). Families whose image
is a variable number of full crops (InternVL's tiles, LLaVA-OneVision's anyres crops) keep one `pixel_values` row
per crop and the count per image in `num_patches` (`crop_rows`).

SmolVLM's processor splits each image into tiles (plus the image resized whole) and returns `pixel_values`
`[samples, max tiles, 3, S, S]` and `pixel_attention_mask` `[samples, max tiles, S, S]`, each sample's tiles padded
with all-zero ones (the model drops a tile whose pixels are all 0). `VisualBatch` keeps its real tiles only, one row
per tile in sample order (`tile_tokens` > 0: each tile is one "image" of the tower and stands for that many prompt
tokens), so slicing is by tile counts, and `model_inputs` pads them back to the processor's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import torch

from vlrft.errors import UserError


class VisualMismatchError(UserError):
    """Prompt token ids and visual tensors disagree (e.g. image-token count != merged patches)."""


class Layout(Enum):
    """What dim 0 of a visual tensor indexes."""

    IMAGE_ROWS = "image_rows"  # prod(thw) rows per image (one row per image when there is no grid)
    VIDEO_ROWS = "video_rows"  # prod(thw) rows per video
    PER_IMAGE = "per_image"  # one entry per image
    PER_VIDEO = "per_video"  # one entry per video
    PER_SAMPLE = "per_sample"  # one entry per sample


@dataclass(frozen=True)
class KeyRule:
    """How to slice one processor output key, and whether `to(dtype=...)` casts it (pixel data only)."""

    layout: Layout
    pixels: bool = False
    model_input: bool = True  # False: bookkeeping VisualBatch slices but the model's forward never sees


# Processor output key -> slicing rule. The four Qwen-VL keys are fields of VisualBatch; any other
# key listed here travels in `VisualBatch.extra`. A new model family registers its keys here.
SLICING_RULES: dict[str, KeyRule] = {
    "pixel_values": KeyRule(Layout.IMAGE_ROWS, pixels=True),
    "image_grid_thw": KeyRule(Layout.PER_IMAGE),
    "pixel_values_videos": KeyRule(Layout.VIDEO_ROWS, pixels=True),
    "video_grid_thw": KeyRule(Layout.PER_VIDEO),
    "second_per_grid_ts": KeyRule(Layout.PER_VIDEO),  # Qwen2.5-VL: seconds per temporal patch, for M-RoPE
    "image_sizes": KeyRule(Layout.PER_IMAGE),  # LLaVA-style families
    "pixel_attention_mask": KeyRule(Layout.PER_IMAGE),  # Idefics/SmolVLM-style families
    # InternVL / LLaVA-OneVision: pixel rows (crops) per image, when there is no grid (`crop_rows`)
    "num_patches": KeyRule(Layout.PER_IMAGE, model_input=False),
    # LLaVA-OneVision: per image, how many images the prompt it was encoded with had (1: anyres crops, more: one crop);
    # `model_inputs` hands the forward one entry per such group (`encoding_groups`)
    "batch_num_images": KeyRule(Layout.PER_IMAGE),
}
# Processor outputs that belong to the text side, not to VisualBatch.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "video_metadata"})
_FIELD_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """Per-token modality ids (0 text, 1 image, 2 video), as transformers' Qwen-VL forward requires with grids."""
    return (input_ids == image_token_id).long() + 2 * (input_ids == video_token_id).long()


def token_type_kwargs(module, types: torch.Tensor) -> dict:
    """The per-token modality ids as `module`'s forward names them: `mm_token_type_ids` (Qwen-VL, GLM-4.1V: M-RoPE
    reads them), `token_type_ids` (Gemma 3: its attention is bidirectional over each image's tokens), or none for a
    forward that takes neither (InternVL 3, LLaVA-OneVision, SmolVLM: `generate` refuses arguments the model does not
    use; SmolVLM's would reach its language model's attention).
    `module` unwrapped from PEFT first (its forward names neither)."""
    import inspect

    module = module.get_base_model() if hasattr(module, "get_base_model") else module
    params = inspect.signature(module.forward).parameters
    if "mm_token_type_ids" in params:
        return {"mm_token_type_ids": types}
    if "token_type_ids" in params:
        return {"token_type_ids": types}
    return {}


CROP_PROCESSORS = ("InternVLProcessor", "LlavaOnevisionProcessor")  # an image is a variable number of full crops


def crop_rows(processor, outputs: Mapping, images_per_sample: Sequence[int]) -> dict:
    """`outputs` of one processor call with each image's crops as rows of `pixel_values` and their count per image in
    `num_patches`, for the families whose image is a variable number of full crops; others' pass unchanged.

    InternVL: its processor already returns one row per tile but drops the count; an image's tiles are its
    `<IMG_CONTEXT>` tokens between `<img>` and `</img>` over `image_seq_length`. LLaVA-OneVision: its processor pads
    every image's crops to the batch's largest count ([images, max crops, 3, H, W]), so a selection of samples would
    carry another padding than the same samples processed alone; the crops are unpadded to rows by the model's own
    rule (an image alone in its prompt: the base crop and its best anyres grid, by `image_sizes`; each image of a
    multi-image prompt: one crop), which its forward takes as they are (4-D pixel values), and `batch_num_images`
    is kept per image (the images of the prompt it was encoded with), so that a multi-turn trajectory that joins a
    prompt's images with a tool's, each encoded alone, still tells the forward how each image was cropped."""
    name = type(processor).__name__
    out, pixels = dict(outputs), outputs.get("pixel_values")
    if name == "LlavaOnevisionProcessor":
        out.pop("batch_num_images", None)
        if pixels is not None:
            out["batch_num_images"] = [n for n in images_per_sample for _ in range(n)]
    if pixels is None or name not in CROP_PROCESSORS:
        return out
    if name == "InternVLProcessor":
        start, context = processor.start_image_token_id, processor.image_token_id
        counts = []
        for ids in out["input_ids"]:
            run = None
            for token in (int(t) for t in ids):
                if token == start:
                    run = 0
                elif token == context and run is not None:
                    run += 1
                elif run is not None:
                    counts.append(run // processor.image_seq_length)
                    run = None
        out["num_patches"] = counts
        return out
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    image_processor = processor.image_processor
    size = image_processor.size
    crop = int(size["height"] if "height" in size else size["shortest_edge"])
    alone = [n == 1 for n in images_per_sample for _ in range(n)]
    counts = [image_size_to_num_patches(list(map(int, hw)), image_processor.image_grid_pinpoints, crop) if one else 1
              for hw, one in zip(out["image_sizes"], alone)]
    out["pixel_values"] = torch.cat([torch.as_tensor(p)[:n] for p, n in zip(pixels, counts)])
    out["num_patches"] = counts
    return out


def encoding_groups(per_image: torch.Tensor) -> torch.Tensor:
    """Per image, the size of the group of images it was encoded with -> one entry per group, in order (what
    LLaVA-OneVision's forward takes as `batch_num_images`: a 1 is an image cropped alone, k > 1 a prompt's k images
    of one crop each). Samples are selected whole, so a group is never cut."""
    groups, i, sizes = [], 0, [int(n) for n in per_image.tolist()]
    while i < len(sizes):
        size = sizes[i]
        if size < 1 or sizes[i:i + size] != [size] * size:
            raise VisualMismatchError(f"batch_num_images {sizes}: the group of {size} image(s) at image {i} is cut")
        groups.append(size)
        i += size
    return torch.tensor(groups, dtype=per_image.dtype, device=per_image.device)


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def _expand_segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate `arange(s, s + n)` for every (s, n) pair without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    offsets = torch.repeat_interleave(starts - _exclusive_cumsum(lengths), lengths)
    return offsets + torch.arange(total, dtype=torch.long)


def _take(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """`tensor[index]` along dim 0; a view (no copy) when `index` is one ascending contiguous run."""
    if tensor is None:
        return None
    n = index.numel()
    if n == 0:
        return tensor[:0]
    first = int(index[0])
    if int(index[-1]) - first + 1 == n and (n == 1 or bool((index[1:] - index[:-1] == 1).all())):
        return tensor.narrow(0, first, n)
    return tensor.index_select(0, index.to(tensor.device))


@dataclass(frozen=True, eq=False)
class VisualBatch:
    """Visual tensors of a batch of samples plus how many images/videos each sample owns.

    A text-only sample owns zero images and zero rows. `merge_size` comes from the processor
    (`image_processor.merge_size`); one prompt token stands for `merge_size**2` patch rows.
    """

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    images_per_sample: tuple[int, ...]
    videos_per_sample: tuple[int, ...]
    merge_size: int
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)  # other keys listed in SLICING_RULES
    # SmolVLM: the rows are tiles (images_per_sample counts tiles), each standing for tile_tokens prompt tokens, and
    # the model takes them padded per sample (see the module docstring). 0: not tiled.
    tile_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "images_per_sample", tuple(int(c) for c in self.images_per_sample))
        object.__setattr__(self, "videos_per_sample", tuple(int(c) for c in self.videos_per_sample))
        if len(self.images_per_sample) != len(self.videos_per_sample):
            raise ValueError(f"images_per_sample has {len(self.images_per_sample)} entries but videos_per_sample "
                             f"has {len(self.videos_per_sample)}; both need one entry per sample")
        for key in self.extra:
            if key not in SLICING_RULES or key in _FIELD_KEYS:
                raise ValueError(f"VisualBatch.extra key '{key}' has no slicing rule; add it to vlrft.vision.SLICING_RULES")
        self._check_counts("image", sum(self.images_per_sample), self.pixel_values, self.image_grid_thw, Layout.PER_IMAGE)
        self._check_counts("video", sum(self.videos_per_sample), self.pixel_values_videos, self.video_grid_thw,
                           Layout.PER_VIDEO)

    def _check_counts(self, kind: str, count: int, pixels, grid, per_item: Layout) -> None:
        if count and pixels is None:
            raise VisualMismatchError(f"the samples own {count} {kind}(s) but there are no {kind} pixels")
        if grid is not None and grid.shape[0] != count:
            raise VisualMismatchError(f"{kind}_grid_thw has {grid.shape[0]} rows but the samples own {count} {kind}(s)")
        rows = self._rows_per_item(grid, count, self.extra.get("num_patches") if per_item is Layout.PER_IMAGE else None)
        if pixels is not None and int(rows.sum()) != pixels.shape[0]:
            raise VisualMismatchError(f"{kind} pixel tensor has {pixels.shape[0]} rows but the grids need "
                                      f"sum(prod(thw)) = {int(rows.sum())}")
        for key, value in self.extra.items():
            if SLICING_RULES[key].layout is per_item and value.shape[0] != count:
                raise VisualMismatchError(f"'{key}' has {value.shape[0]} entries but the samples own {count} {kind}(s)")

    # ------------------------------------------------------------------ construction

    @classmethod
    def empty(cls, num_samples: int, merge_size: int) -> "VisualBatch":
        """A batch of `num_samples` text-only samples."""
        zeros = (0,) * num_samples
        return cls(None, None, None, None, zeros, zeros, merge_size)

    @classmethod
    def from_processor_output(cls, outputs: Mapping, images_per_sample: Sequence[int],
                              videos_per_sample: Sequence[int], merge_size: int, tile_tokens: int = 0) -> "VisualBatch":
        """Wrap the visual keys of one processor call (images/videos flattened in sample order). A tiling processor's
        padded `[samples, max tiles, ...]` tensors (SmolVLM) become one row per real tile; `tile_tokens` is the
        number of prompt tokens a tile stands for (the processor's image_seq_len)."""
        tensors: dict[str, torch.Tensor] = {}
        for key, value in outputs.items():
            if key in TEXT_KEYS or value is None:
                continue
            if key not in SLICING_RULES:
                raise ValueError(f"the processor returned '{key}', which VisualBatch cannot slice; "
                                 "register its layout in vlrft.vision.SLICING_RULES")
            if isinstance(value, (list, tuple)) and value and all(hasattr(v, "shape") for v in value):
                value = torch.stack([torch.as_tensor(v) for v in value])  # Gemma 3: one [3, H, W] array per image
            tensor = torch.as_tensor(value)
            if key == "second_per_grid_ts":
                tensor = tensor.to(torch.float32)
            tensors[key] = tensor
        pixels = tensors.get("pixel_values")
        if pixels is not None and pixels.dim() == 5:
            images_per_sample = cls._real_tiles(tensors, images_per_sample, tile_tokens)
        else:
            tile_tokens = 0
        fields = {k: tensors.pop(k, None) for k in _FIELD_KEYS}
        return cls(**fields, images_per_sample=tuple(images_per_sample), videos_per_sample=tuple(videos_per_sample),
                   merge_size=merge_size, extra=tensors, tile_tokens=tile_tokens)

    @staticmethod
    def _real_tiles(tensors: dict, images_per_sample: Sequence[int], tile_tokens: int) -> list[int]:
        """Keep the real tiles of padded `[samples, max tiles, ...]` tensors (in place); returns tiles per sample."""
        mask = tensors.get("pixel_attention_mask")
        pixels = tensors["pixel_values"]
        if mask is None or tuple(mask.shape) != tuple(pixels.shape[:2]) + tuple(pixels.shape[3:]) or tile_tokens < 1:
            raise ValueError("5-D pixel_values [samples, tiles, C, H, W] need a pixel_attention_mask [samples, tiles, "
                             "H, W] and the tokens a tile stands for (tile_tokens, the processor's image_seq_len)")
        if pixels.shape[0] != len(images_per_sample):
            raise VisualMismatchError(f"pixel_values holds {pixels.shape[0]} samples but {len(images_per_sample)} "
                                      "were encoded")
        real = mask.flatten(2).any(-1)  # a padding tile is masked out whole
        tiles = real.sum(1).tolist()
        if [t > 0 for t in tiles] != [n > 0 for n in images_per_sample]:
            raise VisualMismatchError(f"the samples' tiles {tiles} do not follow their images {list(images_per_sample)}")
        tensors["pixel_values"], tensors["pixel_attention_mask"] = pixels[real], mask[real]
        return tiles

    @classmethod
    def concat(cls, batches: Sequence["VisualBatch"]) -> "VisualBatch":
        """Stack batches sample-wise (the result's samples are batch 0's, then batch 1's, ...)."""
        if not batches:
            raise ValueError("VisualBatch.concat needs at least one batch")
        merge = {b.merge_size for b in batches}
        if len(merge) != 1:
            raise ValueError(f"cannot concatenate visual batches with different merge sizes {sorted(merge)}")

        def cat(values: list[torch.Tensor | None]) -> torch.Tensor | None:
            present = [v for v in values if v is not None]
            return torch.cat(present) if present else None

        tiles = {b.tile_tokens for b in batches if b.tile_tokens}
        if len(tiles) > 1:
            raise ValueError(f"cannot concatenate visual batches whose tiles stand for {sorted(tiles)} tokens")
        extra = {}
        for key in sorted({k for b in batches for k in b.extra}):
            layout = SLICING_RULES[key].layout
            parts = []
            for b in batches:
                if key in b.extra:
                    parts.append(b.extra[key])
                elif b._item_count(layout):
                    raise ValueError(f"cannot concatenate: one batch has '{key}' and another with "
                                     f"{layout.value} data lacks it")
            extra[key] = torch.cat(parts)
        return cls(
            pixel_values=cat([b.pixel_values for b in batches]),
            image_grid_thw=cat([b.image_grid_thw for b in batches]),
            pixel_values_videos=cat([b.pixel_values_videos for b in batches]),
            video_grid_thw=cat([b.video_grid_thw for b in batches]),
            images_per_sample=sum((b.images_per_sample for b in batches), ()),
            videos_per_sample=sum((b.videos_per_sample for b in batches), ()),
            merge_size=batches[0].merge_size,
            extra=extra,
            tile_tokens=tiles.pop() if tiles else 0,
        )

    # ------------------------------------------------------------------ counts and offsets

    @property
    def num_samples(self) -> int:
        return len(self.images_per_sample)

    @property
    def num_images(self) -> int:
        return sum(self.images_per_sample)

    @property
    def num_videos(self) -> int:
        return sum(self.videos_per_sample)

    def _item_count(self, layout: Layout) -> int:
        if layout in (Layout.IMAGE_ROWS, Layout.PER_IMAGE):
            return self.num_images
        if layout in (Layout.VIDEO_ROWS, Layout.PER_VIDEO):
            return self.num_videos
        return self.num_samples

    @staticmethod
    def _rows_per_item(grid: torch.Tensor | None, count: int, crops: torch.Tensor | None = None) -> torch.Tensor:
        if grid is not None:
            return grid.to(torch.long).prod(-1).cpu()
        if crops is not None:  # InternVL's tiles, LLaVA-OneVision's crops: num_patches rows per image
            return crops.to(torch.long).cpu()
        return torch.ones(count, dtype=torch.long)  # other families without grids: one pixel entry per image

    @cached_property
    def _image_rows(self) -> torch.Tensor:
        return self._rows_per_item(self.image_grid_thw, self.num_images, self.extra.get("num_patches"))

    @cached_property
    def _video_rows(self) -> torch.Tensor:
        return self._rows_per_item(self.video_grid_thw, self.num_videos)

    def _tokens_per_sample(self, rows: torch.Tensor, per_sample: tuple[int, ...]) -> list[int]:
        owner = torch.repeat_interleave(torch.arange(len(per_sample)), torch.tensor(per_sample, dtype=torch.long))
        tokens = rows * self.tile_tokens if self.tile_tokens else rows // self.merge_size**2
        sums = torch.zeros(len(per_sample), dtype=torch.long).index_add_(0, owner, tokens)
        return sums.tolist()

    def image_tokens_per_sample(self) -> list[int]:
        """Image tokens each sample's prompt must hold: sum over its images of prod(thw) / merge_size**2."""
        return self._tokens_per_sample(self._image_rows, self.images_per_sample)

    def video_tokens_per_sample(self) -> list[int]:
        """Video tokens each sample's prompt must hold: sum over its videos of prod(thw) / merge_size**2."""
        return self._tokens_per_sample(self._video_rows, self.videos_per_sample)

    # ------------------------------------------------------------------ slicing

    def select(self, indices: Sequence[int]) -> "VisualBatch":
        """The samples at `indices`, in that order; repeats allowed (a group of n completions can share
        its prompt's pixels by repeating its index). Contiguous selections are views, not copies."""
        idx = torch.as_tensor([int(i) for i in indices], dtype=torch.long)
        n = self.num_samples
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"VisualBatch.select: index out of range for {n} samples: {list(indices)}")
        idx = idx % max(n, 1)
        images = torch.tensor(self.images_per_sample, dtype=torch.long)
        videos = torch.tensor(self.videos_per_sample, dtype=torch.long)
        image_idx = _expand_segments(_exclusive_cumsum(images)[idx], images[idx])
        video_idx = _expand_segments(_exclusive_cumsum(videos)[idx], videos[idx])
        image_rows = _expand_segments(_exclusive_cumsum(self._image_rows)[image_idx], self._image_rows[image_idx])
        video_rows = _expand_segments(_exclusive_cumsum(self._video_rows)[video_idx], self._video_rows[video_idx])
        by_layout = {Layout.IMAGE_ROWS: image_rows, Layout.VIDEO_ROWS: video_rows, Layout.PER_IMAGE: image_idx,
                     Layout.PER_VIDEO: video_idx, Layout.PER_SAMPLE: idx}
        taken = {key: _take(getattr(self, key), by_layout[SLICING_RULES[key].layout]) for key in _FIELD_KEYS}
        extra = {key: _take(value, by_layout[SLICING_RULES[key].layout]) for key, value in self.extra.items()}
        return VisualBatch(
            **taken,
            images_per_sample=tuple(images[idx].tolist()),
            videos_per_sample=tuple(videos[idx].tolist()),
            merge_size=self.merge_size,
            extra=extra,
            tile_tokens=self.tile_tokens,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "VisualBatch":
        """Move every tensor to `device`; `dtype` casts only the floating pixel tensors (not grids or timings)."""

        def move(key: str, value: torch.Tensor | None) -> torch.Tensor | None:
            if value is None:
                return None
            cast = dtype if dtype is not None and SLICING_RULES[key].pixels and value.is_floating_point() else None
            return value.to(device=device, dtype=cast) if cast is not None else value.to(device)

        return dataclasses.replace(
            self,
            **{key: move(key, getattr(self, key)) for key in _FIELD_KEYS},
            extra={key: move(key, value) for key, value in self.extra.items()},
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The visual keys this batch has data for, named as the Hugging Face model's forward expects them.

        Keys of a modality with no items (e.g. video keys of an image-only selection) are left out:
        Qwen-VL forwards fail on empty grids.
        """
        tensors = {key: getattr(self, key) for key in _FIELD_KEYS}
        tensors.update(self.extra)
        inputs = {key: value for key, value in tensors.items() if value is not None
                  and SLICING_RULES[key].model_input and self._item_count(SLICING_RULES[key].layout) > 0}
        if self.tile_tokens and self.num_images:
            for key in ("pixel_values", "pixel_attention_mask"):
                if key in inputs:
                    inputs[key] = self._padded_per_sample(inputs[key])
        if "batch_num_images" in inputs:
            inputs["batch_num_images"] = encoding_groups(inputs["batch_num_images"])
        return inputs

    def _padded_per_sample(self, tiles: torch.Tensor) -> torch.Tensor:
        """[tiles, ...] rows -> the processor's [samples, max tiles, ...], each sample's tiles then all-zero ones."""
        counts = torch.tensor(self.images_per_sample, dtype=torch.long)
        out = tiles.new_zeros((self.num_samples, int(counts.max()), *tiles.shape[1:]))
        owner = torch.repeat_interleave(torch.arange(self.num_samples), counts)
        slot = torch.arange(int(counts.sum())) - torch.repeat_interleave(_exclusive_cumsum(counts), counts)
        out[owner.to(tiles.device), slot.to(tiles.device)] = tiles
        return out

    # ------------------------------------------------------------------ checks

    def check(self, input_ids: Sequence[Sequence[int]] | torch.Tensor, image_token_id: int, video_token_id: int,
              sample_names: Sequence[str] | None = None) -> None:
        """Raise `VisualMismatchError` naming the first sample whose prompt ids disagree with its pixels.

        Checks pixel rows == sum(prod(thw)), every grid divisible by merge_size**2, and per sample that
        the number of image (video) tokens in `input_ids` equals its grids' prod(thw) / merge_size**2 (tiles:
        tile_tokens a tile).
        """
        if len(input_ids) != self.num_samples:
            raise VisualMismatchError(f"{len(input_ids)} prompts but the visual batch holds {self.num_samples} samples")
        names = list(sample_names) if sample_names is not None else [f"#{i}" for i in range(self.num_samples)]
        unit = self.merge_size**2
        for kind, rows, pixels in (("image", self._image_rows, self.pixel_values),
                                   ("video", self._video_rows, self.pixel_values_videos)):
            if pixels is not None and int(rows.sum()) != pixels.shape[0]:
                raise VisualMismatchError(f"{kind} pixel tensor has {pixels.shape[0]} rows but the grids need "
                                          f"{int(rows.sum())}")
            bad = (rows % unit).nonzero()
            if bad.numel():
                raise VisualMismatchError(f"{kind} {int(bad[0])} has {int(rows[bad[0]])} patches, not a multiple "
                                          f"of merge_size**2 = {unit}")
        counts = self._count_tokens(input_ids, (image_token_id, video_token_id))
        expected = (self.image_tokens_per_sample(), self.video_tokens_per_sample())
        for kind, k in (("image", 0), ("video", 1)):
            per_sample = self.images_per_sample if k == 0 else self.videos_per_sample
            for i, (have, want) in enumerate(zip(counts[k], expected[k])):
                if have != want:
                    raise VisualMismatchError(
                        f"sample {names[i]}: its prompt ids hold {have} {kind} tokens but its {per_sample[i]} "
                        f"{kind}(s) need {want} (= prod(thw) / merge_size**2 with merge_size {self.merge_size}); "
                        "the prompt ids and pixels were not produced together by one processor call"
                    )

    @staticmethod
    def _count_tokens(input_ids, token_ids: tuple[int, int]) -> tuple[list[int], list[int]]:
        if isinstance(input_ids, torch.Tensor):
            return tuple((input_ids == t).sum(-1).tolist() for t in token_ids)
        rows = [ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) for ids in input_ids]
        return tuple([row.count(t) for row in rows] for t in token_ids)

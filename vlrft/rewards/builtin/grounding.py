"""Grounding reward: intersection-over-union of the predicted box with the reference box.

Boxes are compared in one coordinate system. What the numbers in a box mean depends on who wrote it:

| `coords`          | a box's numbers are                                                            |
| ----------------- | ------------------------------------------------------------------------------ |
| `normalized`      | fractions of the image's width / height (0-1)                                  |
| `relative_1000`   | thousandths of the image's width / height (0-1000); Qwen2-VL and Qwen3-VL      |
| `pixels`          | pixels of the original image (the `image_size` column: `[width, height]`)      |
| `resized_pixels`  | pixels of the image the model saw, after the processor's smart resize;         |
|                   | Qwen2.5-VL (it is trained on absolute coordinates of its resized input)        |

`qwen2_vl`, `qwen2_5_vl` and `qwen3_vl` are accepted as names for their family's convention.
When the completion's `coords` and the reference's `reference_coords` differ, both boxes are
converted to normalized coordinates first. The resized size comes from the `images` the trainer
passes (the images exactly as the processor received them); without them (e.g. scoring offline)
it is computed from `image_size` with `min_pixels` / `max_pixels` / `factor` like the processor.
`box_format` / `reference_box_format` say whether four numbers are `xyxy` (corners) or `xywh`
(top-left corner, width, height; COCO's annotation format).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlrft.rewards.registry import reward
from vlrft.rewards.text import find_answer, last_box
from vlrft.rewards.types import RewardSampleError

Box = tuple[float, float, float, float]

COORDINATE_SYSTEMS = ("normalized", "relative_1000", "pixels", "resized_pixels")
FAMILY_COORDINATES = {"qwen2_vl": "relative_1000", "qwen2_5_vl": "resized_pixels", "qwen3_vl": "relative_1000"}
BOX_FORMATS = ("xyxy", "xywh")


def box_iou(a: Box, b: Box) -> float:
    """IoU of two [x1, y1, x2, y2] boxes; 0.0 when either box is empty or inverted."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def coordinate_system(name: str | None) -> str | None:
    """The canonical coordinate system for a name or a model family name; ValueError for an unknown one."""
    if name is None:
        return None
    canonical = FAMILY_COORDINATES.get(name, name)
    if canonical not in COORDINATE_SYSTEMS:
        raise ValueError(f"unknown coordinate system {name!r}; use one of {', '.join(COORDINATE_SYSTEMS)} "
                         f"or a model family ({', '.join(FAMILY_COORDINATES)})")
    return canonical


def to_xyxy(box: Box, box_format: str) -> Box:
    """A box as corners; `xywh` is (x, y, width, height)."""
    if box_format == "xywh":
        x, y, w, h = box
        return x, y, x + w, y + h
    if box_format != "xyxy":
        raise ValueError(f"unknown box format {box_format!r}; use one of {', '.join(BOX_FORMATS)}")
    return box


def resized_size(width: int, height: int, min_pixels: int, max_pixels: int, factor: int = 28) -> tuple[int, int]:
    """(width, height) of an image after Qwen-VL's smart resize (sides multiples of `factor`, area in bounds)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(int(height), int(width), factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return w, h


def normalize_box(box: Box, coords: str, size: tuple[float, float] | None) -> Box:
    """`box` (xyxy) in `coords` -> fractions of the image; `size` is (width, height) of the pixel grid used."""
    if coords == "normalized":
        return box
    if coords == "relative_1000":
        return tuple(v / 1000.0 for v in box)  # type: ignore[return-value]
    assert size is not None
    w, h = size
    return box[0] / w, box[1] / h, box[2] / w, box[3] / h


def denormalize_box(box: Box, coords: str, size: tuple[float, float] | None) -> Box:
    """Inverse of `normalize_box`: fractions -> `coords` (for writing references a model family expects)."""
    if coords == "normalized":
        return box
    if coords == "relative_1000":
        return tuple(v * 1000.0 for v in box)  # type: ignore[return-value]
    assert size is not None
    w, h = size
    return box[0] * w, box[1] * h, box[2] * w, box[3] * h


def _image_size(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = (value.get("width"), value.get("height"))
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return float(value[0]), float(value[1])
    return None


class _Sizes:
    """The pixel grid (width, height) a `pixels` / `resized_pixels` box of sample i refers to."""

    def __init__(self, images, image_size, min_pixels, max_pixels, factor):
        self.images, self.image_size = images, image_size
        self.min_pixels, self.max_pixels, self.factor = min_pixels, max_pixels, factor

    def original(self, i: int) -> tuple[float, float]:
        size = _image_size(self.image_size[i]) if self.image_size is not None else None
        if size is None:
            raise RewardSampleError(i, "iou: boxes in 'pixels' need the image size; give the dataset an "
                                       "'image_size' column [width, height] (vlrft data prepare writes it)")
        return size

    def resized(self, i: int) -> tuple[float, float]:
        seen = self.images[i] if self.images is not None else None
        if seen:
            return tuple(float(v) for v in seen[0].size)  # type: ignore[return-value]
        if self.min_pixels is None or self.max_pixels is None:
            raise RewardSampleError(i, "iou: 'resized_pixels' boxes need the images the model saw (passed during "
                                       "training) or kwargs min_pixels and max_pixels with an 'image_size' column")
        w, h = self.original(i)
        return tuple(float(v) for v in resized_size(int(w), int(h), self.min_pixels, self.max_pixels, self.factor))

    def for_coords(self, coords: str, i: int) -> tuple[float, float] | None:
        if coords == "pixels":
            return self.original(i)
        if coords == "resized_pixels":
            return self.resized(i)
        return None


@reward("iou")
def iou(
    completions: list[str],
    references: list[str | None],
    threshold: float | None = None,
    coords: str | None = None,
    reference_coords: str | None = None,
    box_format: str = "xyxy",
    reference_box_format: str = "xyxy",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    factor: int = 28,
    images: Sequence[Sequence[Any]] | None = None,
    image_size: Sequence[Any] | None = None,
) -> list[float | None]:
    """IoU of the last box in the final answer (`[x1, y1, x2, y2]` or `(x1,y1),(x2,y2)`) with the reference box;
    with `threshold`, 1.0 when IoU >= threshold else 0.0. No box in the completion scores 0.0.
    `coords` (the completion's) and `reference_coords`: normalized, relative_1000, pixels, resized_pixels, or a
    family name (qwen2_vl, qwen2_5_vl, qwen3_vl); unset means both use the same units (compared as written)."""
    try:
        pred_coords, ref_coords = coordinate_system(coords), coordinate_system(reference_coords)
        to_xyxy((0, 0, 0, 0), box_format), to_xyxy((0, 0, 0, 0), reference_box_format)
    except ValueError as exc:
        raise ValueError(f"iou: {exc}") from None
    convert = pred_coords != ref_coords and pred_coords is not None and ref_coords is not None
    if (pred_coords is None) != (ref_coords is None):
        raise ValueError("iou: give both `coords` (the completion's) and `reference_coords`, or neither")
    sizes = _Sizes(images, image_size, min_pixels, max_pixels, factor)
    scores: list[float | None] = []
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if reference is None or str(reference).strip() == "":
            scores.append(None)
            continue
        expected = last_box(str(reference))
        if expected is None:
            raise RewardSampleError(i, f"iou: reference {str(reference)[:60]!r} is not a box; write it as '[x1, y1, x2, y2]'")
        expected = to_xyxy(expected, reference_box_format)
        got = last_box(find_answer(completion)[0])
        if got is None:
            scores.append(0.0)
            continue
        got = to_xyxy(got, box_format)
        if convert:
            expected = normalize_box(expected, ref_coords, sizes.for_coords(ref_coords, i))
            got = normalize_box(got, pred_coords, sizes.for_coords(pred_coords, i))
        value = box_iou(got, expected)
        scores.append(value if threshold is None else float(value >= threshold))
    return scores

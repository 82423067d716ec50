"""RefCOCO / RefCOCO+ / RefCOCOg referring-expression grounding (as in VLM-R1), scored by IoU.

Raw files (the refer release, one dataset folder) and COCO's train2014 images:

    SOURCE/refs(unc).p        pickled list of refs {"ref_id", "ann_id", "image_id", "split",
                              "sentences": [{"sent_id", "sent"}], ...}; refs(umd).p / refs(google).p
                              for RefCOCOg (first found of unc, umd, google is used)
    SOURCE/instances.json     COCO-style {"images": [{"id", "file_name", "width", "height"}],
                              "annotations": [{"id", "image_id", "bbox": [x, y, w, h]}], "categories"}
    train2014/COCO_train2014_000000581857.jpg   at SOURCE/train2014, SOURCE/../train2014,
                              SOURCE/../images/mscoco/images/train2014, or --image-dir

One row per (ref, sentence); splits are the refs' (train, val, testA, testB, test). Rows: prompt
`<image>` + the template with {expression}; `answer` the box as `[x1, y1, x2, y2]` in normalized
(0-1) coordinates of the image; `box` the same numbers; `image_size` [width, height] of the image
file; `label` "grounding". Train with `iou` and `reference_coords: normalized` plus the model's
`coords` (see vlrft/rewards/builtin/grounding.py).

Checks: a box that leaves the annotated image, or has no area, is skipped (COCO boxes are
[x, y, width, height]; pass `--box-format xyxy` for files that write corners); an image file whose
size differs from the annotation is kept when it is a resized copy (same aspect ratio, so the
normalized box still fits) and skipped otherwise. The refs pickle is read with an unpickler that
refuses every class and function (`vlrft.safe_load.load_plain_pickle`): a planted file is refused by
name, nothing in it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, image_size, read_json
from vlrft.errors import UserError
from vlrft.safe_load import load_plain_pickle

REFS_FILES = ("refs(unc).p", "refs(umd).p", "refs(google).p")
_FIX = "use the file of the refer release (a pickle of lists, dicts, strings and numbers only)"
ASPECT_TOLERANCE = 0.01  # relative difference of width/height ratios still counted as the same image


def _load_refs(source: Path) -> list[dict]:
    for name in REFS_FILES:
        path = source / name
        if path.is_file():
            try:  # plain lists, dicts, strings and numbers only: a pickle naming any class or function is refused
                return load_plain_pickle(path, what="refs file", fix=_FIX)
            except UnicodeDecodeError:  # written by Python 2
                return load_plain_pickle(path, what="refs file", fix=_FIX, encoding="latin1")
    raise UserError(f"no refs file in '{source}': expected one of {', '.join(REFS_FILES)} (the refer release)")


def _image_dirs(source: Path, options: Options) -> list[Path]:
    if options.image_dir:
        return [options.image_dir]
    return [source / "train2014", source.parent / "train2014", source.parent / "images" / "mscoco" / "images" /
            "train2014", source / "images"]


def _find(dirs: list[Path], name: str) -> Path:
    for folder in dirs:
        if (folder / name).is_file():
            return folder / name
    return dirs[0] / name


def normalized_box(bbox: list[float], box_format: str, width: float, height: float) -> list[float] | None:
    """[x1, y1, x2, y2] as fractions of the image, or None when the box has no area or leaves the image."""
    x1, y1, a, b = (float(v) for v in bbox)
    x2, y2 = (x1 + a, y1 + b) if box_format == "xywh" else (a, b)
    slack = 1.0  # annotation tools round to the pixel
    if x2 <= x1 or y2 <= y1 or x1 < -slack or y1 < -slack or x2 > width + slack or y2 > height + slack:
        return None
    clip = lambda v, hi: min(max(v, 0.0), hi)  # noqa: E731
    return [round(clip(x1, width) / width, 4), round(clip(y1, height) / height, 4),
            round(clip(x2, width) / width, 4), round(clip(y2, height) / height, 4)]


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    refs = _load_refs(source)
    instances = read_json(source / "instances.json", "instances.json (COCO annotations of the refs)")
    images = {img["id"]: img for img in instances.get("images", [])}
    annotations = {ann["id"]: ann for ann in instances.get("annotations", [])}
    box_format = options.box_format or "xywh"
    dirs = _image_dirs(source, options)
    for ref in refs:
        split = str(ref.get("split", "train"))
        ref_id = str(ref.get("ref_id"))
        ann = annotations.get(ref.get("ann_id"))
        info = images.get(ref.get("image_id"))
        if ann is None or info is None:
            yield Skipped(split, ref_id, "ref without annotation or image entry",
                          f"ann_id {ref.get('ann_id')}, image_id {ref.get('image_id')}")
            continue
        width, height = float(info["width"]), float(info["height"])
        box = normalized_box(ann["bbox"], box_format, width, height)
        if box is None:
            yield Skipped(split, ref_id, "box outside the image or empty",
                          f"bbox {ann['bbox']} in a {info['width']}x{info['height']} image read as {box_format}; "
                          "COCO writes [x, y, width, height], pass --box-format xyxy for corner boxes")
            continue
        path = _find(dirs, info["file_name"])
        actual = image_size(str(path)) if path.is_file() else None
        if actual is not None and actual != (int(width), int(height)):
            if abs(actual[0] / actual[1] - width / height) > ASPECT_TOLERANCE * (width / height):
                yield Skipped(split, ref_id, "image size differs from the annotation",
                              f"{path.name} is {actual[0]}x{actual[1]}, annotated {info['width']}x{info['height']}")
                continue
        size = list(actual) if actual is not None else [int(width), int(height)]
        answer = "[" + ", ".join(f"{v:g}" for v in box) + "]"
        for sentence in ref.get("sentences", []):
            text = str(sentence.get("sent") or sentence.get("raw") or "").strip()
            row_id = f"{ref_id}-{sentence.get('sent_id')}"
            if not text:
                yield Skipped(split, row_id, "empty expression")
                continue
            yield Item(split, row_id, {"expression": text}, answer=answer, label="grounding", images=[path],
                       extra={"box": box, "image_size": size, "ref_id": int(ref.get("ref_id", -1))})

"""`vlrft data convert`: rewrite any supported layout as native JSONL with media written as files.

`convert_dataset("geo3k/train.parquet", "out/train.jsonl")` writes `out/train.jsonl` and the media
under `out/train_media/`, referenced by paths relative to the JSONL file (so the default
`data.image_root` finds them). Encoded image bytes are written unchanged (no re-encoding loss);
in-memory images (PIL, arrays) become PNG; video files are copied; frame lists become folders.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlrft.data.media import MediaError, encode_image_bytes, local_path, open_image_source, to_rgb
from vlrft.data.readers import read_dataset
from vlrft.data.sample import BadSampleError, Sample, SkippedSample

NATIVE_FIELDS = ("id", "prompt", "images", "videos", "answer", "label")


@dataclass
class ConvertReport:
    source: str
    target: str
    layout: str
    written: int = 0
    media_files: int = 0
    skipped: list[SkippedSample] = field(default_factory=list)


def _image_bytes(ref: Any) -> tuple[bytes, str]:
    """(encoded bytes, extension) of an image reference, keeping the original encoding when there is one."""
    if isinstance(ref, dict):
        for key in ("image", "url", "bytes", "path"):
            if ref.get(key) is not None:
                return _image_bytes(ref[key])
    raw = None
    if isinstance(ref, (bytes, bytearray, memoryview)):
        raw = bytes(ref)
    elif isinstance(ref, str) and ref.startswith("data:"):
        try:
            raw = base64.b64decode(ref.partition(",")[2], validate=True)
        except ValueError as exc:  # binascii.Error
            raise MediaError(f"the data URI is not valid base64 ({exc})") from None
    elif isinstance(ref, (str, Path)) and not str(ref).startswith(("http://", "https://")):
        path = local_path(str(ref))
        if path.is_file():
            raw = path.read_bytes()
    if raw is not None:
        try:
            fmt = Image.open(io.BytesIO(raw)).format
        except Exception:
            raise MediaError(f"the image ({len(raw)} bytes) is not an image PIL can read") from None
        return raw, (fmt or "png").lower().replace("jpeg", "jpg")
    image = open_image_source(ref)  # PIL image, numpy array, or raises MediaError (missing file, URL, ...)
    try:
        if image.mode not in ("RGB", "RGBA", "L", "LA", "P"):
            image = to_rgb(image)
        return encode_image_bytes(image, "PNG"), "png"
    except Exception as exc:  # noqa: BLE001 - Pillow decoding the pixels of a corrupt or hostile image
        raise MediaError(f"the image cannot be decoded: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") \
            from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "data:application/octet-stream;base64," + base64.b64encode(bytes(value)).decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"a column value of type {type(value).__name__} cannot be written to JSON")


class _MediaWriter:
    def __init__(self, jsonl: Path):
        self.base = jsonl.parent
        self.folder = jsonl.parent / f"{jsonl.stem}_media"
        self.count = 0

    def _target(self, name: str) -> Path:
        target = self.folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        self.count += 1
        return target

    def image(self, row: int, k: int, ref: Any, stem: str = "image") -> str:
        data, ext = _image_bytes(ref)
        target = self._target(f"{row:06d}_{stem}{k}.{ext}")
        target.write_bytes(data)
        return target.relative_to(self.base).as_posix()

    def video(self, row: int, k: int, ref: Any) -> str | list[str]:
        if isinstance(ref, (list, tuple)):
            return [self.image(row, f, frame, stem=f"video{k}_frame") for f, frame in enumerate(ref)]
        if isinstance(ref, dict) and ref.get("video") is not None:
            ref = ref["video"]
        if not isinstance(ref, (str, Path)) or str(ref).startswith(("http://", "https://")):
            raise MediaError(f"cannot copy video reference {str(ref)[:60]!r}; use a local file or a list of frames")
        path = local_path(str(ref))
        if not path.is_file():
            raise MediaError(f"video file not found: '{path}'")
        target = self._target(f"{row:06d}_video{k}{path.suffix}")
        shutil.copyfile(path, target)
        return target.relative_to(self.base).as_posix()


# Columns by which `detect_format` recognises another layout: kept under a `source_` name, so the output reads as native.
LAYOUT_MARKERS = ("problem", "reward_model", "data_source", "extra_info", "image", "solution")


def _native_row(sample: Sample, images: list, videos: list) -> dict:
    row: dict[str, Any] = {}
    for key, value in sample.extra.items():
        name = f"extra_{key}" if key in NATIVE_FIELDS else f"source_{key}" if key in LAYOUT_MARKERS else key
        row[name] = value
    row.update(id=sample.id, prompt=sample.prompt, images=images, videos=videos, answer=sample.answer,
               label=sample.label)
    return row


def convert_dataset(source: str | Path, target: str | Path, format: str = "auto", image_root: str | None = None,
                    on_bad_sample: str = "error") -> ConvertReport:
    """Convert `source` (any supported layout) to native JSONL at `target`; see the module docstring."""
    target = Path(target)
    if target.suffix != ".jsonl":
        raise BadSampleError(str(target), None, "<target>", "the output must be a .jsonl file path")
    read = read_dataset(source, format, image_root, on_bad_sample)
    report = ConvertReport(str(source), str(target), next(iter(read.formats.values()), format),
                           skipped=list(read.skipped))
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = _MediaWriter(target)
    lines = []
    for row_number, sample in enumerate(read.samples):
        try:
            images, videos = [], []
            for k, ref in enumerate(sample.images):
                field_name = f"images[{k}]"
                images.append(writer.image(row_number, k, ref))
            for k, ref in enumerate(sample.videos):
                field_name = f"videos[{k}]"
                videos.append(writer.video(row_number, k, ref))
        except MediaError as exc:
            error = BadSampleError(sample.source, sample.id, field_name, str(exc))
            if on_bad_sample != "skip":
                raise error from None
            report.skipped.append(SkippedSample.from_error(error, sample))
            continue
        lines.append(json.dumps(_native_row(sample, images, videos), ensure_ascii=False, default=_json_default))
    target.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    report.written = len(lines)
    report.media_files = writer.count
    return report

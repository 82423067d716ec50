"""Read datasets into `Sample`s: JSONL (or a JSON list), parquet, and `datasets.save_to_disk` folders.

Images stay references (paths, or the raw bytes parquet/Arrow hold); they are decoded only when a
batch is encoded. Relative paths resolve against `image_root`, by default the data file's folder.
A bad row raises `BadSampleError` naming file, row and field, or is counted and skipped when
`on_bad_sample="skip"`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlrft.config import DataConfig
from vlrft.data.presets import FORMATS, PRESETS, detect_format, resolve_paths
from vlrft.data.sample import BadSampleError, Sample, SkippedSample
from vlrft.errors import UserError

_ARROW_BATCH = 512
logger = logging.getLogger(__name__)


@dataclass
class ReadResult:
    """Samples read from one or more files, the rows skipped as bad, and the layout used per file."""

    samples: list[Sample] = field(default_factory=list)
    skipped: list[SkippedSample] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)  # file -> layout

    @property
    def rows(self) -> int:
        return len(self.samples) + len(self.skipped)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(source, 0-based row index, parsed row or BadSampleError) for every non-empty line."""
    index = 0
    with path.open("rb") as handle:  # decoded line by line, so one bad byte spoils one row, not the file
        for line_no, raw in enumerate(handle, start=1):
            source = f"{path.name} line {line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield source, index, BadSampleError(
                    source, None, "<row>", f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "save the file as UTF-8")
                index += 1
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                row = BadSampleError(source, None, "<row>", f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                     "each line must hold one JSON object")
            yield source, index, row
            index += 1


def _iter_json_list(path: Path) -> Iterator[tuple[str, int, Any]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"'{path}' is not valid UTF-8 (byte 0x{data[exc.start]:02x} on line {line}); save it as "
                        "UTF-8") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"'{path}' is not valid JSON ({exc.msg} at line {exc.lineno}); for one object per line "
                        "name the file .jsonl") from None
    if not isinstance(rows, list):
        raise UserError(f"'{path}' must hold a JSON list of rows (or use JSONL, one object per line)")
    for index, row in enumerate(rows):
        yield f"{path.name} item {index}", index, row


def _iter_arrow_tables(tables: Iterator[Any], name: str) -> Iterator[tuple[str, int, Any]]:
    index = 0
    for table in tables:
        for row in table.to_pylist():
            yield f"{name} row {index}", index, row
            index += 1


def _iter_parquet(path: Path) -> Iterator[tuple[str, int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise UserError(f"cannot read parquet file '{path}': {exc}") from None
    yield from _iter_arrow_tables(parquet.iter_batches(batch_size=_ARROW_BATCH), path.name)


def _iter_hf_folder(path: Path) -> Iterator[tuple[str, int, Any]]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise UserError(f"'{path}' holds a DatasetDict with splits {splits}; pass one split's folder, "
                        f"e.g. '{path / (splits[0] if splits else 'train')}'")
    import datasets

    dataset = datasets.load_from_disk(str(path))
    # Arrow format keeps images as raw {"bytes", "path"} instead of decoding every image up front.
    arrow = dataset.with_format("arrow")
    tables = (arrow[start:start + _ARROW_BATCH] for start in range(0, len(dataset), _ARROW_BATCH))
    yield from _iter_arrow_tables(tables, path.name)


def _iter_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or \
                (path / "dataset_dict.json").is_file():
            return _iter_hf_folder(path)
        parquet_files = sorted(path.glob("*.parquet"))
        if parquet_files:
            return (item for f in parquet_files for item in _iter_parquet(f))
        raise UserError(f"'{path}' is a folder but neither a datasets.save_to_disk folder nor a folder of parquet "
                        "files; pass a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json_list(path)
    if suffix == ".parquet":
        return _iter_parquet(path)
    raise UserError(f"'{path}' has an unknown file type '{suffix}'; use .jsonl, .json, .parquet or a "
                    "datasets.save_to_disk folder")


def read_dataset(path: str | Path, format: str = "auto", image_root: str | None = None,
                 on_bad_sample: str = "error", limit: int | None = None) -> ReadResult:
    """Read one dataset file or folder; see the module docstring."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"dataset '{path}' not found; check data.train_files / data.eval_files")
    if format != "auto" and format not in PRESETS:
        raise UserError(f"data.format={format!r} is not known; use one of auto, {', '.join(FORMATS)}")
    root = Path(image_root).expanduser() if image_root else (p if p.is_dir() else p.parent)
    result = ReadResult()
    layout = None if format == "auto" else format
    stem = p.stem if p.is_file() else p.name
    for source, index, row in _iter_rows(p):
        if limit is not None and len(result.samples) >= limit:
            break
        try:
            if isinstance(row, BadSampleError):
                raise row
            if not isinstance(row, dict):
                raise BadSampleError(source, None, "<row>", f"expected an object with columns, got {type(row).__name__}")
            if layout is None:
                layout = detect_format(set(row), f"{p.name} (first row)")
            sample_id = str(row["id"]) if row.get("id") is not None else f"{stem}-{index}"
            sample = PRESETS[layout](row, source, sample_id)
            resolve_paths(sample, root)
        except BadSampleError as exc:
            if on_bad_sample != "skip" or exc.field == "<columns>":
                raise
            result.skipped.append(SkippedSample.from_error(exc))
            continue
        result.samples.append(sample)
    result.formats[str(p)] = layout or "empty"
    if result.skipped:
        logger.warning("%s: skipped %d bad row(s) of %d (data.on_bad_sample=skip); first: %s", p.name,
                       len(result.skipped), result.rows, result.skipped[0])
    return result


def read_samples(path: str | Path, format: str = "auto", image_root: str | None = None,
                 on_bad_sample: str = "error", limit: int | None = None) -> list[Sample]:
    """Samples of one dataset file or folder (bad rows raise, or are dropped with `on_bad_sample="skip"`)."""
    return read_dataset(path, format, image_root, on_bad_sample, limit).samples


def read_files(paths: Sequence[str | Path], format: str = "auto", image_root: str | None = None,
               on_bad_sample: str = "error", limit: int | None = None) -> ReadResult:
    """Read several files in order (e.g. `data.train_files`); `limit` caps the total sample count."""
    total = ReadResult()
    for path in paths:
        left = None if limit is None else limit - len(total.samples)
        if left is not None and left <= 0:
            break
        part = read_dataset(path, format, image_root, on_bad_sample, left)
        total.samples += part.samples
        total.skipped += part.skipped
        total.formats.update(part.formats)
    return total


def read_split(cfg: DataConfig, split: str = "train") -> ReadResult:
    """The `train` or `eval` files of a data config, with its format, image root, bad-row policy and cap."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    files = cfg.train_files if split == "train" else cfg.eval_files
    limit = cfg.max_train_samples if split == "train" else cfg.max_eval_samples
    if split == "train" and not files:
        raise UserError("data.train_files is empty; list one or more .jsonl/.parquet files or dataset folders")
    return read_files(files, cfg.format, cfg.image_root, cfg.on_bad_sample, limit)

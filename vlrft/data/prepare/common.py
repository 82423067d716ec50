"""What every `vlrft data prepare` task shares: items, skips, prompt templates, writing and the summary.

A task module reads its dataset's raw release and yields `Item`s (one future row) or `Skipped`
records (a row that cannot be used, with a short reason that is counted). `prepare` then drops
duplicate ids, checks every image/video file exists (and images open), fills the task's prompt
template, and writes one native-layout file per split, keeping the release's own split names:
`OUT/<split>.jsonl` with absolute image paths, or with `embed_images` `OUT/<split>.parquet` with
the image bytes inside. The summary (printed and written as `OUT/summary.json`) counts rows and
skips per reason, histograms image sizes and, given a model, measures prompt lengths in tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from vlrft.errors import MissingDependencyError, UserError

TEMPLATES_FILE = Path(__file__).with_name("templates.yaml")
SIZE_BUCKETS = (256, 512, 1024, 2048)  # longest image side, for the summary's histogram
MAX_EXAMPLES = 20  # skipped rows listed by name in the summary (all are counted)


@dataclass
class Item:
    """One row to write. `fields` fill the task's prompt template; `hint` picks one of its `hints`."""

    split: str
    id: str
    fields: dict[str, str]
    answer: str
    label: str
    images: list[Path] = field(default_factory=list)
    videos: list[Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    hint: str | None = None


@dataclass
class Skipped:
    """A raw row left out: `reason` is the counted category, `detail` names the row."""

    split: str
    id: str
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.split}/{self.id}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Options:
    """What the command line gives a task (besides the source folder)."""

    image_dir: Path | None = None  # where the images are when not where the release puts them
    box_format: str | None = None  # grounding: override the annotation's box format (xywh / xyxy)
    all_questions: bool = False  # clevr: keep every question, not only counting ones
    media_dir: Path | None = None  # where images that exist only as bytes in the release are written
    val_fraction: float = 0.0  # a release with one split: this share of its images/videos becomes val, the rest train


@dataclass
class Summary:
    task: str
    source: str
    out: str
    files: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: list[str] = field(default_factory=list)
    image_sizes: dict[str, int] = field(default_factory=dict)  # longest side bucket -> images
    image_width_range: list[int] = field(default_factory=list)
    image_height_range: list[int] = field(default_factory=list)
    prompt_suffix: str | None = None
    system_prompt: str | None = None
    prompt_tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> stats (with a model)
    model: str | None = None

    def text(self) -> str:
        lines = [f"prepared {self.task} from {self.source} -> {self.out}"]
        for split, n in self.rows.items():
            lines.append(f"  {split}: {n} rows -> {self.files[split]}")
        lines.append("  labels: " + (", ".join(f"{k}: {v}" for k, v in self.labels.items()) or "none"))
        total = sum(self.skipped.values())
        lines.append(f"  skipped: {total} rows" + (": " + ", ".join(f"{k}: {v}" for k, v in self.skipped.items())
                                                  if total else ""))
        lines += [f"    e.g. {example}" for example in self.skipped_examples[:5]]
        if self.image_sizes:
            lines.append("  images by longest side: " + ", ".join(f"{k}: {v}" for k, v in self.image_sizes.items())
                         + f" (width {self.image_width_range[0]}-{self.image_width_range[1]}, height "
                           f"{self.image_height_range[0]}-{self.image_height_range[1]})")
        for split, stats in self.prompt_tokens.items():
            lines.append(f"  prompt tokens ({split}, incl. vision tokens and the suffix): "
                         + ", ".join(f"{k} {v}" for k, v in stats.items()))
        if self.prompt_suffix:
            lines.append(f"  train with data.prompt_suffix: {json.dumps(self.prompt_suffix)}")
        return "\n".join(lines)


def load_templates(task: str, override: str | Path | None = None) -> dict[str, Any]:
    """The task's template entry from templates.yaml, with the keys of `override`'s entry for the task replaced."""
    templates = yaml.safe_load(TEMPLATES_FILE.read_text(encoding="utf-8"))
    entry = dict(templates[task])
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise UserError(f"--templates {str(path)!r} not found")
        mine = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(mine, dict) or not isinstance(mine.get(task, {}), dict):
            raise UserError(f"--templates {path}: expected a mapping task -> {{prompt, prompt_suffix, ...}}")
        unknown = set(mine.get(task, {})) - {"prompt", "prompt_suffix", "system_prompt", "hints"}
        if unknown:
            raise UserError(f"--templates {path}: unknown keys {sorted(unknown)} for {task}; use prompt, "
                            "prompt_suffix, system_prompt, hints")
        entry.update(mine.get(task, {}))
    return entry


@functools.lru_cache(maxsize=65536)
def image_size(path: str) -> tuple[int, int] | None:
    """(width, height) from the file's header, or None when it is not an image PIL can open."""
    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


@functools.lru_cache(maxsize=65536)
def video_problem(path: str) -> str | None:
    """Why the video at `path` cannot be used (no stream, no frame count, nothing decodes), or None: what
    training's video loader needs, checked from the file's start (`vlrft.data.media.check_video_file`)."""
    from vlrft.data.media import MediaError, check_video_file

    try:
        import av  # noqa: F401  without it no video can be checked (nor trained on): one error, not a skip per row
    except ImportError:
        raise MissingDependencyError("preparing rows with videos checks that each decodes, which needs PyAV; "
                                     "install it with: pip install 'vlrft[video]'") from None
    try:
        check_video_file(Path(path))
    except MediaError as exc:
        return str(exc)
    return None


_CHOICE_KEY = re.compile(r"^\(?([A-Za-z])[.):]?$")


def choice_list(value: Any) -> list[str] | None:
    """A release's choices as a list of option texts: a list as it is; a dict keyed by option letters ("A", "(B)")
    or by positions (0, "1") in that order; None when there are none. Raises ValueError for another form."""
    if value is None or (isinstance(value, (list, tuple, dict, str)) and not value):
        return None
    if isinstance(value, (list, tuple)):
        return [str(c) for c in value]
    if isinstance(value, dict):
        keys = [str(k).strip() for k in value]
        letters = [_CHOICE_KEY.match(k) for k in keys]
        if all(letters):
            order = sorted(range(len(keys)), key=lambda i: letters[i].group(1).upper())
            if [letters[i].group(1).upper() for i in order] == [chr(65 + k) for k in range(len(keys))]:
                return [str(list(value.values())[i]) for i in order]
        if all(k.isdigit() for k in keys):
            order = sorted(range(len(keys)), key=lambda i: int(keys[i]))
            if sorted(int(k) for k in keys) in (list(range(len(keys))), list(range(1, len(keys) + 1))):
                return [str(list(value.values())[i]) for i in order]
    raise ValueError(f"choices {str(value)[:80]!r} are neither a list nor keyed by option letters A, B, ... or "
                     "positions 0, 1, ...")


def _size_bucket(size: tuple[int, int]) -> str:
    side = max(size)
    for edge in SIZE_BUCKETS:
        if side <= edge:
            return f"<={edge}"
    return f">{SIZE_BUCKETS[-1]}"


def render_prompt(item: Item, templates: dict[str, Any]) -> str:
    """The row's prompt: one placeholder per image/video, then the task template filled with the item's fields."""
    values = dict(item.fields)
    values.setdefault("hint", "")
    hints = templates.get("hints") or {}
    if item.hint is not None and item.hint in hints:
        values["hint"] = hints[item.hint].format(**item.fields)
    try:
        text = templates["prompt"].format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise UserError(f"prompt template {templates['prompt']!r} cannot be filled ({exc!r}); its fields are "
                        f"{', '.join('{' + k + '}' for k in sorted(values))}") from None
    return "<image>" * len(item.images) + "<video>" * len(item.videos) + text


def held_out(rows: dict[str, list[dict]], fraction: float) -> dict[str, list[dict]]:
    """The one split of `rows` cut into train and val: a row goes to val when a hash of its media's file names (its id
    when it has none) falls in the first `fraction` of the range, so every question about one image or video stays on
    one side, and the same release gives the same split on every run, wherever it is unpacked and whether its images
    are embedded or not (names, not absolute paths)."""
    if not 0 < fraction < 1:
        raise UserError(f"--val-fraction {fraction}: give a share between 0 and 1, e.g. 0.05")
    if len(rows) > 1:
        raise UserError(f"--val-fraction is for a release with one split; this one has {', '.join(rows)}: train "
                        "on its own splits, or prepare one of them from a folder of its own")
    split: dict[str, list[dict]] = {"train": [], "val": []}
    for row in next(iter(rows.values()), []):
        media = row.get("videos") or [m if isinstance(m, str) else m.get("path", "") for m in row.get("images") or []]
        key = "\n".join(Path(str(m)).name for m in media) or str(row["id"])
        share = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2 ** 64
        split["val" if share < fraction else "train"].append(row)
    return {name: part for name, part in split.items() if part}


def _previous_files(out: Path) -> set[Path]:
    """The split files an earlier `prepare` into `out` wrote (its summary.json lists them); nothing else is touched."""
    try:
        files = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    found = set()
    for path in files.values() if isinstance(files, dict) else []:
        path = Path(str(path))
        if path.suffix in (".jsonl", ".parquet") and path.resolve().parent == out.resolve():
            found.add(path.resolve())
    return found


def prepare_items(task: str, items: Iterator[Item | Skipped], out: Path, templates: dict[str, Any],
                  embed_images: bool = False, source: str = "", val_fraction: float = 0.0) -> Summary:
    """Validate, render and write `items` (see the module docstring); returns the summary (not yet with tokens).
    `val_fraction`: the release's one split becomes train and val (`held_out`)."""
    summary = Summary(task, source, str(out), prompt_suffix=templates.get("prompt_suffix"),
                      system_prompt=templates.get("system_prompt"))
    rows: dict[str, list[dict]] = {}
    seen: dict[str, set[str]] = {}
    skipped: Counter = Counter()
    labels: Counter = Counter()
    sizes: Counter = Counter()
    widths, heights = [], []

    def skip(record: Skipped) -> None:
        skipped[record.reason] += 1
        if len(summary.skipped_examples) < MAX_EXAMPLES:
            summary.skipped_examples.append(str(record))

    for item in items:
        if isinstance(item, Skipped):
            skip(item)
            continue
        ids = seen.setdefault(item.split, set())
        if item.id in ids:
            skip(Skipped(item.split, item.id, "duplicate id", "an earlier row of this split has the same id; "
                                                               "the first one is kept"))
            continue
        if item.answer is None or not str(item.answer).strip():
            skip(Skipped(item.split, item.id, "no answer"))
            continue
        missing = [p for p in item.images + item.videos if not Path(p).is_file()]
        if missing:
            skip(Skipped(item.split, item.id, "missing image" if Path(missing[0]) in map(Path, item.images)
                         else "missing video", str(missing[0])))
            continue
        item_sizes = [image_size(str(p)) for p in item.images]
        if any(s is None for s in item_sizes):
            skip(Skipped(item.split, item.id, "unreadable image",
                         str(item.images[item_sizes.index(None)])))
            continue
        bad_video = next((problem for problem in (video_problem(str(p)) for p in item.videos) if problem), None)
        if bad_video:
            skip(Skipped(item.split, item.id, "unreadable video", bad_video))
            continue
        ids.add(item.id)
        for s in item_sizes:
            sizes[_size_bucket(s)] += 1
            widths.append(s[0])
            heights.append(s[1])
        labels[item.label] += 1
        images: list[Any] = [str(Path(p).resolve()) for p in item.images]
        if embed_images:
            images = [{"bytes": Path(p).read_bytes(), "path": Path(p).name} for p in item.images]
        row = {"id": item.id, "prompt": render_prompt(item, templates), "images": images,
               "videos": [str(Path(p).resolve()) for p in item.videos], "answer": str(item.answer).strip(),
               "label": item.label, **item.extra}
        rows.setdefault(item.split, []).append(row)

    if val_fraction > 0:
        rows = held_out(rows, val_fraction)
    out.mkdir(parents=True, exist_ok=True)
    stale = _previous_files(out)
    for split, split_rows in rows.items():
        path = out / f"{split}.{'parquet' if embed_images else 'jsonl'}"
        _write(path, split_rows)
        summary.files[split] = str(path)
        summary.rows[split] = len(split_rows)
    for path in stale - {Path(p).resolve() for p in summary.files.values()}:
        path.unlink(missing_ok=True)  # a split of an earlier run into this folder that this run did not write
    summary.labels = dict(sorted(labels.items()))
    summary.skipped = dict(skipped.most_common())
    order = [f"<={e}" for e in SIZE_BUCKETS] + [f">{SIZE_BUCKETS[-1]}"]
    summary.image_sizes = {k: sizes[k] for k in order if sizes[k]}
    if widths:
        summary.image_width_range = [min(widths), max(widths)]
        summary.image_height_range = [min(heights), max(heights)]
    return summary


def _write(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd")
        return
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def measure_prompts(summary: Summary, processor: Any, model: str, data: Any = None) -> None:
    """Prompt lengths in tokens (vision tokens and the prompt suffix included) per split, with `model`'s processor.

    `data` (a training config's `DataConfig`) supplies the pixel bounds, video sampling and, when it sets
    them, the prompt suffix / system prompt that training will use; its `max_prompt_length` is reported
    as the number of prompts over it.
    """
    import dataclasses

    import numpy as np

    from vlrft.config import DataConfig
    from vlrft.data.check import check_dataset

    base = data if data is not None else DataConfig()
    suffix = base.prompt_suffix if data is not None and base.prompt_suffix is not None else summary.prompt_suffix
    system = base.system_prompt if data is not None and base.system_prompt is not None else summary.system_prompt
    cfg = dataclasses.replace(base, format="auto", image_root=None, prompt_suffix=suffix, system_prompt=system,
                              max_prompt_length=2**31)
    summary.model = model
    summary.prompt_suffix, summary.system_prompt = suffix, system
    for split, path in summary.files.items():
        report = check_dataset(path, cfg, processor)
        if not report.prompt_lengths:
            continue
        lengths = np.asarray(report.prompt_lengths)
        stats = {"min": int(lengths.min()), "p50": int(np.percentile(lengths, 50)),
                 "p90": int(np.percentile(lengths, 90)), "p99": int(np.percentile(lengths, 99)),
                 "max": int(lengths.max())}
        if data is not None:
            stats[f"over_{data.max_prompt_length}"] = int((lengths > data.max_prompt_length).sum())
        summary.prompt_tokens[split] = stats


def write_summary(summary: Summary) -> Path:
    path = Path(summary.out) / "summary.json"
    path.write_text(json.dumps(asdict(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_json(path: Path, what: str) -> Any:
    """A raw annotation file, or a UserError naming the file and the release layout it belongs to."""
    if not path.is_file():
        raise UserError(f"{what} not found at '{path}'")
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a file saved with a byte-order mark reads too
    except json.JSONDecodeError as exc:
        raise UserError(f"'{path}' is not valid JSON ({exc.msg} at line {exc.lineno})") from None

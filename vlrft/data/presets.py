"""Column-mapping presets: one function per dataset layout turning a raw row into a `Sample`.

Layouts (the `data.format` values):

- native: `prompt` (text with `<image>`/`<video>` placeholders, or chat messages), `images`,
  `videos`, `answer`, `label`, optional `id`; every other column goes to `extra`.
- easyr1 (geometry3k): `problem`, `answer`, `images` (and `videos`).
- verl / LightRFT parquet: `prompt` (chat messages), `images`, `videos`,
  `reward_model.ground_truth` -> answer, `data_source` -> label, `extra_info` and the rest -> extra.
- trl: `prompt` (text or messages), `image` or `images`, `answer` or `solution`; prompts with no
  image placeholder get their images at the start of the first user message, as TRL does.
- openrlhf: `prompt`, `images`, `label` (OpenRLHF's label is the reference answer, so it becomes
  `answer`), `datasource` -> label.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlrft.data.sample import BadSampleError, Sample, normalize_prompt

FORMATS = ("native", "easyr1", "verl", "trl", "openrlhf")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _text_or_none(value: Any, source: str, sample_id: str, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise BadSampleError(source, sample_id, field, f"expected text, got {type(value).__name__} {str(value)[:60]!r}")


def _require(row: dict, key: str, source: str, sample_id: str, layout: str) -> Any:
    if row.get(key) is None:
        raise BadSampleError(source, sample_id, key, f"the column '{key}' is missing or null; the {layout} layout needs "
                             f"it (see `vlrft data check --help` for the layouts, or set data.format)")
    return row[key]


def _build(row: dict, source: str, sample_id: str, *, prompt: Any, images: Any, videos: Any, answer: Any,
           label: Any, used: set[str], answer_field: str, images_first: bool = False) -> Sample:
    prompt, image_list, video_list = normalize_prompt(prompt, _as_list(images), _as_list(videos), source, sample_id,
                                                      images_first=images_first)
    extra = {k: v for k, v in row.items() if k not in used}
    return Sample(
        id=sample_id,
        prompt=prompt,
        images=image_list,
        videos=video_list,
        answer=_text_or_none(answer, source, sample_id, answer_field),
        label=_text_or_none(label, source, sample_id, "label"),
        extra=extra,
        source=source,
    )


def native(row: dict, source: str, sample_id: str) -> Sample:
    return _build(row, source, sample_id, prompt=_require(row, "prompt", source, sample_id, "native"),
                  images=row.get("images"), videos=row.get("videos"), answer=row.get("answer"),
                  label=row.get("label"), used={"id", "prompt", "images", "videos", "answer", "label"},
                  answer_field="answer")


def easyr1(row: dict, source: str, sample_id: str) -> Sample:
    return _build(row, source, sample_id, prompt=_require(row, "problem", source, sample_id, "easyr1"),
                  images=row.get("images"), videos=row.get("videos"), answer=row.get("answer"),
                  label=None, used={"id", "problem", "images", "videos", "answer"}, answer_field="answer")


def verl(row: dict, source: str, sample_id: str) -> Sample:
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise BadSampleError(source, sample_id, "reward_model", "expected a mapping with 'ground_truth'")
    return _build(row, source, sample_id, prompt=_require(row, "prompt", source, sample_id, "verl"),
                  images=row.get("images"), videos=row.get("videos"), answer=reward_model.get("ground_truth"),
                  label=row.get("data_source"), used={"id", "prompt", "images", "videos"},
                  answer_field="reward_model.ground_truth")


def trl(row: dict, source: str, sample_id: str) -> Sample:
    images = row.get("images") if row.get("images") is not None else row.get("image")
    answer_key = "answer" if row.get("answer") is not None else "solution"
    return _build(row, source, sample_id, prompt=_require(row, "prompt", source, sample_id, "trl"),
                  images=images, videos=row.get("videos"), answer=row.get(answer_key), label=None,
                  used={"id", "prompt", "image", "images", "videos"}, answer_field=answer_key, images_first=True)


def openrlhf(row: dict, source: str, sample_id: str) -> Sample:
    return _build(row, source, sample_id, prompt=_require(row, "prompt", source, sample_id, "openrlhf"),
                  images=row.get("images"), videos=row.get("videos"), answer=row.get("label"),
                  label=row.get("datasource"), used={"id", "prompt", "images", "videos", "label"},
                  answer_field="label")


PRESETS: dict[str, Callable[[dict, str, str], Sample]] = {
    "native": native, "easyr1": easyr1, "verl": verl, "trl": trl, "openrlhf": openrlhf,
}


def detect_format(columns: set[str], where: str) -> str:
    """Guess the layout from a row's columns (first matching rule); raise when nothing fits."""
    if "problem" in columns:
        return "easyr1"
    if columns & {"reward_model", "data_source", "extra_info"}:
        return "verl"
    if "prompt" not in columns:
        raise BadSampleError(where, None, "<columns>", f"cannot tell the dataset layout from the columns "
                             f"{sorted(columns)}; expected 'prompt' (native, trl, openrlhf, verl) or 'problem' "
                             "(easyr1), or set data.format")
    if "image" in columns or ("solution" in columns and "answer" not in columns):
        return "trl"
    if "label" in columns and "answer" not in columns:
        return "openrlhf"
    return "native"


def resolve_paths(sample: Sample, root: Path) -> None:
    """Make the sample's relative file references absolute under `root` (in place, at read time)."""
    sample.images = [_resolve(ref, root) for ref in sample.images]
    sample.videos = [[_resolve(f, root) for f in ref] if isinstance(ref, (list, tuple)) else _resolve(ref, root)
                     for ref in sample.videos]


def _resolve(ref: Any, root: Path) -> Any:
    if isinstance(ref, dict):
        if ref.get("bytes") is None and isinstance(ref.get("path"), str):
            return {**ref, "path": _resolve(ref["path"], root)}
        for key in ("image", "video"):
            if isinstance(ref.get(key), str):
                return {**ref, key: _resolve(ref[key], root)}
        return ref
    if isinstance(ref, Path):
        ref = str(ref)
    if not isinstance(ref, str) or ref.startswith(("data:", "http://", "https://", "file://")):
        return ref
    path = Path(ref).expanduser()
    return str(path if path.is_absolute() else root / path)

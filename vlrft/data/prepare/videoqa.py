"""Video question answering: Video-R1's annotation format, or MSRVTT-QA's.

Raw files, either form:

    Video-R1:   SOURCE/<name>.json  [{"problem_id", "problem", "data_type": "video" | "image",
                "problem_type": "multiple choice" | "numerical" | "regression" | "OCR" | "free-form",
                "options": ["A. ...", ...], "solution": "<answer>B</answer>", "path": "./dir/clip.mp4"}]
                (paths relative to SOURCE)
    MSRVTT-QA:  SOURCE/train_qa.json, val_qa.json, test_qa.json  [{"id", "question", "answer",
                "video_id": 7010}] with SOURCE/videos/video7010.mp4

The split is the file's name (`train_qa.json` -> train; a Video-R1 file -> its stem, "train"
when the name has "train" in it). Rows: `<video>` (or `<image>`) + `{question}{choices}{hint}`;
`label` "multiple_choice" (answer = letter, `choices` column, `choice` reward), "numeric"
(`numeric`), or "free_form" (`exact_match`). Videos stay files referenced by absolute path
(also with --embed-images).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, read_json
from vlrft.errors import UserError

_OPTION_PREFIX = re.compile(r"^\(?([A-Z])[.):]\s*")
_TYPES = {"multiple choice": "multiple_choice", "numerical": "numeric", "regression": "numeric",
          "ocr": "free_form", "free-form": "free_form"}


def _answer(solution: str) -> str:
    match = re.search(r"<answer>(.*?)</answer>", solution, re.S)
    return (match.group(1) if match else solution).strip()


def _split(path: Path) -> str:
    stem = path.stem
    if stem.endswith("_qa"):
        return stem[:-3]
    return "train" if "train" in stem.lower() else stem


def _video_r1(path: Path, rows: list, source: Path, options: Options) -> Iterator[Item | Skipped]:
    split = _split(path)
    for k, row in enumerate(rows):
        row_id = str(row.get("problem_id", k))
        label = _TYPES.get(str(row.get("problem_type", "")).lower())
        if label is None:
            yield Skipped(split, row_id, "unknown problem_type", str(row.get("problem_type")))
            continue
        media = (options.image_dir or source) / str(row.get("path", ""))
        is_video = row.get("data_type", "video") == "video"
        answer = _answer(str(row.get("solution", "")))
        options_text = [str(o) for o in row.get("options") or []]
        fields = {"question": str(row.get("problem", "")).strip(), "choices": ""}
        extra = {"choices": None, "source_dataset": row.get("data_source")}
        if label == "multiple_choice":
            if not options_text:
                yield Skipped(split, row_id, "multiple choice without options")
                continue
            fields["choices"] = "\nOptions:\n" + "\n".join(options_text)
            extra["choices"] = [_OPTION_PREFIX.sub("", o) for o in options_text]
            answer = answer.strip("(). ").upper()[:1]
        yield Item(split, row_id, fields, answer=answer, label=label, images=[] if is_video else [media],
                   videos=[media] if is_video else [], extra=extra, hint=label)


def _msrvtt(path: Path, rows: list, source: Path, options: Options) -> Iterator[Item | Skipped]:
    split = _split(path)
    video_dir = options.image_dir or source / "videos"
    for k, row in enumerate(rows):
        video_id = str(row.get("video_id", ""))
        name = video_id if video_id.startswith("video") else f"video{video_id}"
        yield Item(split, str(row.get("id", k)), {"question": str(row.get("question", "")).strip(), "choices": ""},
                   answer=str(row.get("answer", "")), label="free_form", videos=[video_dir / f"{name}.mp4"],
                   extra={"choices": None, "source_dataset": "msrvtt_qa"}, hint="free_form")


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    files = sorted(p for p in source.glob("*.json") if p.name != "summary.json")
    if not files:
        raise UserError(f"no annotation .json in '{source}': expected a Video-R1 file or MSRVTT-QA's train_qa.json")
    for path in files:
        rows = read_json(path, "video QA annotation file")
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            continue
        if "problem_type" in rows[0]:
            yield from _video_r1(path, rows, source, options)
        elif "video_id" in rows[0]:
            yield from _msrvtt(path, rows, source, options)

"""Video question answering: Video-R1's annotation format, or MSRVTT-QA's.

Raw files, either form:

    Video-R1:   SOURCE/<name>.json  [{"problem_id", "problem", "data_type": "video" | "image",
                "problem_type": "multiple choice" | "numerical" | "regression" | "OCR" | "free-form",
                "options": ["A. ...", ...], "solution": "<answer>B</answer>", "path": "./dir/clip.mp4"}]
                (paths relative to SOURCE)
    MSRVTT-QA:  SOURCE/train_qa.json, val_qa.json, test_qa.json  [{"id", "question", "answer",
                "video_id": 7010}] with SOURCE/videos/video7010.mp4

The split is the file's name for MSRVTT-QA (`train_qa.json` -> train); a Video-R1 file is "train"
(`Video-R1-260k.json`, as the videoqa recipe reads it) unless its name says test, val or eval. The
release's chain-of-thought file (`Video-R1-COT-165k.json`: the same questions with reasoning, for
SFT) is left out, counted as one skipped file. Rows: `<video>` (or `<image>`) +
`{question}{choices}{hint}`; `label` "multiple_choice" (answer = letter, `choices` column, `choice`
reward), "numeric" (`numeric`) for a plain number or a number and words ("3 objects": `numeric` reads its
number, where math-verify would score "3" wrong), "math" for a numerical answer written otherwise
(`$\frac{3}{2}$`: the recipe's default `accuracy`, math-verify, scores "1.5" right), or "free_form"
(`exact_match`). Options may be a list ("A. ...") or a dict keyed by letters. Videos stay files
referenced by absolute path (also with --embed-images); one that does not decode is left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, choice_list, read_json
from vlrft.errors import UserError

_OPTION_PREFIX = re.compile(r"^\(?([A-Z])[.):]\s*")
_TYPES = {"multiple choice": "multiple_choice", "numerical": "numeric", "regression": "numeric",
          "ocr": "free_form", "free-form": "free_form"}
_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
# A number and words (a count of things, a measure): "3 objects", "2.5 meters", "40%"; no LaTeX, no fraction
_NUMBER_AND_WORDS = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)\s*[A-Za-z%°][A-Za-z%°\s.'-]*$")
_HELD_OUT = re.compile(r"(^|[^a-z])(test|val|valid|validation|eval)([^a-z]|$)")


def _answer(solution: str) -> str:
    match = re.search(r"<answer>(.*?)</answer>", solution, re.S)
    return (match.group(1) if match else solution).strip()


def _split(path: Path) -> str:
    stem = path.stem
    if stem.endswith("_qa"):
        return stem[:-3]
    return stem if _HELD_OUT.search(stem.lower()) else "train"


def _is_chain_of_thought(path: Path, rows: list) -> bool:
    """Video-R1's SFT file: the RL file's questions again, each with a written reasoning (`process`)."""
    return "cot" in re.split(r"[^a-z]+", path.stem.lower()) or "process" in rows[0]


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
        raw_options = row.get("options")
        try:
            listed = choice_list(raw_options)
        except ValueError as exc:
            yield Skipped(split, row_id, "choices in an unknown form", str(exc))
            continue
        options_text = [f"{chr(65 + k)}. {o}" for k, o in enumerate(listed)] if isinstance(raw_options, dict) \
            else listed or []
        if label == "numeric" and not (_PLAIN_NUMBER.match(answer) or _NUMBER_AND_WORDS.match(answer)):
            label = "math"  # LaTeX or a fraction: math-verify compares it, the numeric reward would not
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
                   videos=[media] if is_video else [], extra=extra, hint="numeric" if label == "math" else label)


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
            if _is_chain_of_thought(path, rows):
                yield Skipped(_split(path), path.name, "chain-of-thought file left out",
                              "the RL file's questions again, with reasoning for SFT")
                continue
            yield from _video_r1(path, rows, source, options)
        elif "video_id" in rows[0]:
            yield from _msrvtt(path, rows, source, options)

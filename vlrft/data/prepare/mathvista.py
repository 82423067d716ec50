"""MathVista and MathVision: math questions over images, multiple choice or free-form.

Raw files, either release form:

    MathVista (GitHub):       SOURCE/data/testmini.json  {pid: {"question", "image": "images/1.jpg", "choices",
                              "answer", "question_type", "answer_type", "unit", "precision", ...}}
                              SOURCE/data/images/1.jpg     (also SOURCE/testmini.json + SOURCE/images/;
                              the clone's data/query.json and data/source.json map pid -> text: not rows)
    MathVista (Hub parquet):  SOURCE/data/testmini-00000-of-00001.parquet (same columns + decoded_image bytes)
    MathVision:               SOURCE/data/test-*.parquet or SOURCE/test.jsonl / testmini.jsonl with
                              {"id", "question", "options", "image", "answer", "level", "subject"}
                              (answer: a letter when there are options)

The split is the file's name (testmini, test). Rows: prompt `<image>{question}{choices}{hint}`;
multiple choice -> `answer` = option letter, `label` "multiple_choice", `choices` column (the
`choice` reward accepts the letter or the option's text); free-form -> `answer` the value, `label`
"free_form" (`math_accuracy`, which rounds to the row's `precision` when it has one), with `unit` /
`precision`. A free-form MathVista row's hint carries the answer format its published query gives
(`Hint: ... a Python list ..., e.g., [1, 2, 3] ...`, `... one decimal place ...`): the `Hint:` line of
the row's `query` (the parquet's column, or the clone's data/query.json), else the same sentence built from
`answer_type` / `precision` as MathVista's query builder words it (template field {format_hint}). Images
that exist only as bytes in the parquet are written to OUT/media/. Rows without an answer (MathVista's test
split) are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vlrft.data.prepare.common import Item, Options, Skipped, choice_list, read_json
from vlrft.data.prepare.geometry3k import format_choices
from vlrft.errors import UserError

_IMAGE_TAG = re.compile(r"<image\d*>")  # MathVision marks the image's place as <image1>


def _files(source: Path) -> list[Path]:
    found: list[Path] = []
    for folder in (source / "data", source):
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if p.suffix in (".json", ".jsonl", ".parquet")
                            and not p.name.startswith(("annot", "summary")))
        if found:
            break
    return found


def _split_name(path: Path) -> str:
    return path.stem.split("-")[0]


def _rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        for line in path.read_text(encoding="utf-8-sig").splitlines():
            if line.strip():
                yield json.loads(line)
    else:
        data = read_json(path, "MathVista annotation file")
        rows = list(data.values()) if isinstance(data, dict) else data
        if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
            yield from rows
        # else not annotation rows: the GitHub clone's query.json / source.json (pid -> text) sit beside them


def _image(row: dict, base: Path, options: Options, split: str, row_id: str) -> Path | None:
    ref = row.get("image")
    candidates = [base / ref, base.parent / ref] if isinstance(ref, str) and ref else []
    if options.image_dir and isinstance(ref, str):
        candidates.insert(0, options.image_dir / Path(ref).name)
    for path in candidates:
        if path.is_file():
            return path
    decoded = row.get("decoded_image")
    if isinstance(decoded, dict) and decoded.get("bytes") and options.media_dir is not None:
        name = Path(decoded.get("path") or ref or f"{row_id}.png").name
        target = options.media_dir / split / f"{row_id}_{name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(decoded["bytes"])
        return target
    return candidates[0] if candidates else None


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


_HINT_LINE = re.compile(r"^\s*Hint:\s*(.+?)\s*$", re.M)
_DECIMALS = {1: "one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4",
             2: "two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45"}


def _queries(folder: Path, cache: dict[Path, dict]) -> dict:
    """The GitHub clone's data/query.json beside the annotation file (pid -> the published query), or {}."""
    if folder not in cache:
        path = folder / "query.json"
        data = read_json(path, "MathVista query file") if path.is_file() else {}
        cache[folder] = data if isinstance(data, dict) else {}
    return cache[folder]


def format_hint(row: dict, query: Any) -> str:
    """A free-form row's answer-format sentence: the `Hint:` line of its published `query`, else the one MathVista's
    query builder writes for its `answer_type` / `precision`; "" when neither says anything (MathVision)."""
    found = _HINT_LINE.search(query) if isinstance(query, str) else None
    if found:
        return found.group(1)
    kind, precision = _text(row.get("answer_type")), row.get("precision")
    if kind == "integer":
        return "Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, " \
               "at the end."
    if kind == "float" and precision is not None and int(float(precision)) in _DECIMALS:
        return f"Please answer the question requiring a floating-point number with {_DECIMALS[int(float(precision))]}, " \
               "at the end."
    if kind == "list":
        return "Please answer the question requiring a Python list as an answer and provide the final list, e.g., " \
               "[1, 2, 3], [1.2, 1.3, 1.4], at the end."
    return ""


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    files = _files(source)
    if not files:
        raise UserError(f"no annotation file in '{source}': expected data/testmini.json (MathVista), "
                        "data/*.parquet or test.jsonl (MathVision)")
    queries: dict[Path, dict] = {}
    for path in files:
        split = _split_name(path)
        for k, row in enumerate(_rows(path)):
            row_id = _text(row.get("pid", row.get("id", k)))
            try:
                choices = choice_list(row.get("choices") if row.get("choices") is not None else row.get("options"))
            except ValueError as exc:
                yield Skipped(split, row_id, "choices in an unknown form", str(exc))
                continue
            question = _IMAGE_TAG.sub("", _text(row.get("question"))).strip()
            answer = _text(row.get("answer"))
            if not question:
                yield Skipped(split, row_id, "no question")
                continue
            if not answer:
                yield Skipped(split, row_id, "no answer", "unlabeled split")
                continue
            image = _image(row, path.parent, options, split, row_id)
            if image is None:
                yield Skipped(split, row_id, "no image reference")
                continue
            unit = _text(row.get("unit"))
            fields = {"question": question, "choices": "", "unit_hint": f" (unit: {unit})" if unit else "",
                      "format_hint": ""}
            extra: dict[str, Any] = {"choices": choices, "unit": unit or None, "precision": None}
            if choices and row.get("question_type", "multi_choice") == "multi_choice":
                letter = answer.upper() if len(answer) == 1 and 0 <= ord(answer.upper()) - 65 < len(choices) else None
                if letter is None and answer in choices:
                    letter = chr(65 + choices.index(answer))
                if letter is None:
                    yield Skipped(split, row_id, "answer is not one of the choices", f"{answer!r} not in {choices}")
                    continue
                fields["choices"] = format_choices(choices)
                yield Item(split, row_id, fields, answer=letter, label="multiple_choice", images=[image],
                           extra=extra, hint="multiple_choice")
                continue
            if row.get("precision") is not None:
                extra["precision"] = float(row["precision"])
            query = row.get("query") or _queries(path.parent, queries).get(_text(row.get("pid")))
            hint = format_hint(row, query) if "pid" in row else ""  # MathVista's rows: MathVision's carry "id"
            fields["format_hint"] = f"\nHint: {hint}" if hint else ""
            yield Item(split, row_id, fields, answer=answer, label="free_form", images=[image], extra=extra,
                       hint="free_form")

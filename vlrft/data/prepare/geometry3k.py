"""Geometry3K (Inter-GPS release): geometry problems with a diagram, answered free-form as in EasyR1.

Raw files (the unpacked `geometry3k.zip` of the Inter-GPS repository):

    SOURCE/train/<id>/data.json      {"id", "problem_text", "choices": [4 values], "answer": "C", ...}
    SOURCE/train/<id>/img_diagram.png
    SOURCE/val/<id>/...   SOURCE/test/<id>/...

Rows: prompt `<image>{question}` (the problem text), `answer` = the value of the correct option
(EasyR1's recipe: `math_accuracy` on a `\\boxed{}` answer), `label` "geometry", plus `choices`
(the four values) and `answer_option` (the letter) for a multiple-choice variant (`choice` reward).
Template fields: {question}, {choices} ("\\nChoices:\\nA. ...").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, choice_list

SPLITS = ("train", "val", "test")


def format_choices(choices: list) -> str:
    return "\nChoices:\n" + "\n".join(f"{chr(65 + k)}. {c}" for k, c in enumerate(choices))


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    for split in SPLITS:
        folder = source / split
        if not folder.is_dir():
            continue
        problems = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name))
        for problem in problems:
            data_file = problem / "data.json"
            if not data_file.is_file():
                yield Skipped(split, problem.name, "no data.json", str(data_file))
                continue
            try:
                data = json.loads(data_file.read_text(encoding="utf-8-sig"))
            except json.JSONDecodeError as exc:
                yield Skipped(split, problem.name, "unreadable data.json", exc.msg)
                continue
            problem_id = str(data.get("id", problem.name))
            try:
                choices = choice_list(data.get("choices")) or []
            except ValueError as exc:
                yield Skipped(split, problem_id, "choices in an unknown form", str(exc))
                continue
            letter = str(data.get("answer", "")).strip().upper()
            index = ord(letter) - 65 if len(letter) == 1 else -1
            if not 0 <= index < len(choices):
                yield Skipped(split, problem_id, "answer is not one of the choices",
                              f"answer {data.get('answer')!r} with {len(choices)} choices")
                continue
            question = str(data.get("problem_text", "")).strip()
            if not question:
                yield Skipped(split, problem_id, "no problem_text")
                continue
            yield Item(split, problem_id, {"question": question, "choices": format_choices(choices)},
                       answer=str(choices[index]), label="geometry", images=[problem / "img_diagram.png"],
                       extra={"choices": [str(c) for c in choices], "answer_option": letter})

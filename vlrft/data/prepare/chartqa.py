"""ChartQA: questions about chart images, scored with ChartQA's relaxed accuracy (5% for numbers).

Raw files (the `ChartQA Dataset` folder of the release):

    SOURCE/train/train_human.json       [{"imgname": "41699051005347.png", "query": ..., "label": ...}]
    SOURCE/train/train_augmented.json   (machine-generated questions, same columns)
    SOURCE/train/png/41699051005347.png
    SOURCE/val/..., SOURCE/test/...     (val_human.json, test_augmented.json, ...)

Rows: prompt `<image>{question}`, `answer` the release's label, `label` "numeric" when the answer
is a number (`numeric` reward with rel_tol 0.05, ChartQA's relaxed accuracy) else "text"
(`exact_match`); `question_source` says human or augmented. ChartQA has no question ids: a row's
id is the image name plus a hash of the question, so a question repeated for the same chart
(it happens across the human and augmented files) is kept once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, read_json
from vlrft.errors import UserError

SPLITS = ("train", "val", "test")
KINDS = ("human", "augmented")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?%?|[-+]?\.\d+%?")


def answer_label(answer: str) -> str:
    return "numeric" if _NUMBER.fullmatch(answer.strip()) else "text"


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    found = False
    for split in SPLITS:
        for kind in KINDS:
            path = source / split / f"{split}_{kind}.json"
            if not path.is_file():
                continue
            found = True
            image_dir = options.image_dir or source / split / "png"
            rows = read_json(path, f"ChartQA {split}_{kind}.json")
            for k, row in enumerate(rows):
                name, question, answer = row.get("imgname"), str(row.get("query", "")).strip(), row.get("label")
                if not name or not question:
                    yield Skipped(split, f"{kind}-{k}", "no imgname or query")
                    continue
                digest = hashlib.sha1(question.encode()).hexdigest()[:10]
                answer = "" if answer is None else str(answer).strip()
                yield Item(split, f"{Path(name).stem}-{digest}", {"question": question}, answer=answer,
                           label=answer_label(answer), images=[image_dir / name],
                           extra={"question_source": kind})
    if not found:
        raise UserError(f"no ChartQA annotation files in '{source}': expected train/train_human.json, "
                        "train/train_augmented.json, val/..., test/... next to png/ folders")

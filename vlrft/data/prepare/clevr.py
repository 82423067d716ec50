"""CLEVR / CLEVR-CoGenT / SuperCLEVR questions; by default the counting ones, as R1-V trains on.

Raw files (the unpacked release):

    SOURCE/questions/CLEVR_<split>_questions.json   {"questions": [{"question_index", "image_filename",
                                                      "question", "answer", "split", ...}]}
    SOURCE/images/<split>/CLEVR_<split>_000000.png
    (CoGenT: CLEVR_trainA_questions.json + images/trainA/ ...; SuperCLEVR: superCLEVR_questions_*.json
     at SOURCE or SOURCE/questions, images in SOURCE/images/)

Rows: prompt `<image>{question}{hint}`, `answer` the release's answer, `label` "count" for numeric answers
(`numeric` reward), else "yes_no" / "attribute" (`exact_match`), with `--all-questions`. Counting-only rows
have no hint and train with the template's prompt_suffix ("final answer (number)"); with `--all-questions`
every row's hint is the suffix for its own answer kind (number / yes or no / a single word), and the summary
reports no prompt_suffix (leave data.prompt_suffix unset: it would ask for a number on every row). SuperCLEVR
writes yes/no answers as JSON booleans: they become "yes" / "no". Questions without an answer
(CLEVR's test split) are skipped. SuperCLEVR's questions all carry split "new": `--val-fraction`
cuts them into train and val. Template fields: {question}.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vlrft.data.prepare.common import Item, Options, Skipped, read_json
from vlrft.errors import UserError


def _question_files(source: Path) -> list[Path]:
    files = sorted((source / "questions").glob("*questions*.json")) if (source / "questions").is_dir() else []
    return files or sorted(source.glob("*questions*.json"))


def _split_of(path: Path, data: dict) -> str:
    info_split = (data.get("info") or {}).get("split") if isinstance(data.get("info"), dict) else None
    if info_split:
        return str(info_split)
    parts = path.stem.split("_")  # CLEVR_train_questions -> train
    return parts[1] if len(parts) == 3 and parts[0].lower() == "clevr" else "train"


def _image_path(source: Path, image_dir: Path | None, split: str, filename: str) -> Path:
    roots = [image_dir] if image_dir else [source / "images" / split, source / "images", source / split]
    for root in roots:
        if (root / filename).is_file():
            return root / filename
    return roots[0] / filename  # reported as missing


def _label(answer: str) -> str:
    if answer.strip().lstrip("-").isdigit():
        return "count"
    return "yes_no" if answer.strip().lower() in ("yes", "no") else "attribute"


def items(source: Path, options: Options) -> Iterator[Item | Skipped]:
    files = _question_files(source)
    if not files:
        raise UserError(f"no questions file in '{source}': expected questions/CLEVR_<split>_questions.json "
                        "(CLEVR) or *questions*.json (SuperCLEVR)")
    for path in files:
        data = read_json(path, "CLEVR questions file")
        questions = data.get("questions") if isinstance(data, dict) else data
        if not isinstance(questions, list):
            raise UserError(f"'{path}' has no 'questions' list; is it a CLEVR questions file?")
        file_split = _split_of(path, data if isinstance(data, dict) else {})
        for k, q in enumerate(questions):
            split = str(q.get("split") or file_split)
            qid = str(q.get("question_index", k))
            answer = q.get("answer")
            if answer is None:
                yield Skipped(split, qid, "no answer", "unlabeled split")
                continue
            answer = ("yes" if answer else "no") if isinstance(answer, bool) else str(answer)  # SuperCLEVR: true/false
            label = _label(answer)
            if label != "count" and not options.all_questions:
                yield Skipped(split, qid, "not a counting question", "pass --all-questions to keep it")
                continue
            if not q.get("image_filename") or not q.get("question"):
                yield Skipped(split, qid, "no image_filename or question")
                continue
            image = _image_path(source, options.image_dir, split, q["image_filename"])
            yield Item(split, qid, {"question": str(q["question"]).strip()}, answer=answer, label=label,
                       images=[image], extra={"image_index": q.get("image_index")},
                       hint=label if options.all_questions else None)


def summary_prompt_suffix(options: Options, suffix: str | None) -> str | None:
    """The data.prompt_suffix to train with: none with --all-questions (each row carries its own, see above)."""
    return None if options.all_questions else suffix

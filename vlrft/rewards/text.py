"""Answer extraction and normalisation for rule-based rewards.

Completions are untrusted text (possibly megabytes of garbage), so everything here is linear time:
tags are found with `str.rfind`, braces are matched by one scan, and regexes only ever see the short
tail of an answer (`MAX_ANSWER_CHARS`) and contain no nested quantifiers.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 2000  # longer answers are cut to their tail (the final answer is at the end)


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` (or `\\fbox{...}`), or None."""
    start = -1
    for command in ("\\boxed{", "\\fbox{"):
        pos = text.rfind(command)
        if pos > start:
            start, width = pos, len(command)
    if start < 0:
        return None
    depth, i = 1, start + width
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # skip escaped characters such as \{ and \}
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + width : i]
        i += 1
    return None


def tagged(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>` pair, or None."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    open_ = text.rfind(f"<{tag}>", 0, close)
    if open_ < 0:
        return None
    return text[open_ + len(tag) + 2 : close]


def find_answer(text: str) -> tuple[str, bool]:
    """(answer, marked): the last `<answer>` block (its `\\boxed{}` if it has one), else the last `\\boxed{}`
    (marked=True); else the whole text (marked=False). Stripped and cut to the last `MAX_ANSWER_CHARS` characters."""
    answer = tagged(text, "answer")
    if answer is not None:
        answer = last_boxed(answer) or answer
    else:
        answer = last_boxed(text)
    marked = answer is not None
    return (answer if marked else text).strip()[-MAX_ANSWER_CHARS:], marked


def extract_answer(text: str) -> str:
    """The final answer of a completion (see `find_answer`)."""
    return find_answer(text)[0]


_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_EDGE_PUNCTUATION = " \t\r\n.,;:!?'\"`*$"


def normalize(text: str) -> str:
    """Case-folded, whitespace-collapsed, without surrounding punctuation, `$`, `**` or a `\\text{}` wrapper."""
    text = text.strip()[-MAX_ANSWER_CHARS:].strip(_EDGE_PUNCTUATION)
    match = _TEXT_WRAPPER.match(text)
    if match:
        text = match.group(1).strip(_EDGE_PUNCTUATION)
    return " ".join(text.casefold().split())


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
_NUMBER_WORDS = {
    w: float(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
}
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def last_number(text: str) -> float | None:
    """The last number written in `text` (digits like `1,234.5` / `-3e2`, or a word zero..twenty), or None."""
    tail = text[-MAX_ANSWER_CHARS:]
    best: tuple[int, float] | None = None
    for match in _NUMBER.finditer(tail):
        best = (match.end(), float(match.group().replace(",", "")))
    for match in _NUMBER_WORD.finditer(tail):
        if best is None or match.end() > best[0]:
            best = (match.end(), _NUMBER_WORDS[match.group().lower()])
    return None if best is None else best[1]


_COORD = r"\s*([-+]?\d+(?:\.\d+)?)\s*"
# [x1, y1, x2, y2]  or  (x1,y1),(x2,y2)  (Qwen2-VL's <|box_start|> format)
_BOX = re.compile(rf"[\[(]{_COORD},{_COORD}(?:[\])]\s*,?\s*[\[(]|,){_COORD},{_COORD}[\])]")


def last_box(text: str) -> tuple[float, float, float, float] | None:
    """The last box written as `[x1, y1, x2, y2]` or `(x1,y1),(x2,y2)` in `text`, or None."""
    found = None
    for match in _BOX.finditer(text[-MAX_ANSWER_CHARS:]):
        found = match
    if found is None:
        return None
    x1, y1, x2, y2 = (float(g) for g in found.groups())
    return x1, y1, x2, y2


_LETTER_ALONE = re.compile(r"\(?([A-Za-z])\)?[.:]?")
_LETTER_LEADING = re.compile(r"\(?([A-Z])(?:\)|[.:])(?:\s|$)")
_LETTER_STATED = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*[:\-]?\s*(?:(?i:option)\s*)?\(?([A-Z])\)?(?![A-Za-z])")


def choice_letter(text: str) -> str | None:
    """The chosen option letter: a tagged answer like `B`, `(B)`, `B. 45°`; else 'the answer is (B)' in the
    text's tail; else a completion that is just the letter. Upper-case, or None."""
    answer, marked = find_answer(text)
    if marked:
        match = _LETTER_ALONE.fullmatch(answer) or _LETTER_LEADING.match(answer)
        return match.group(1).upper() if match else None
    tail = text[-MAX_ANSWER_CHARS:]
    stated = list(_LETTER_STATED.finditer(tail))
    if stated:
        return stated[-1].group(1).upper()
    match = _LETTER_ALONE.fullmatch(tail.strip())
    return match.group(1).upper() if match else None

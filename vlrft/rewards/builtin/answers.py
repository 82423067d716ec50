"""Answer-checking rewards: 1.0 for a correct final answer, 0.0 for a wrong one, None without a reference.

The final answer is the last `<answer>...</answer>` block, else the last `\\boxed{...}`, else the whole
completion (see `vlrft.rewards.text.find_answer`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from vlrft.rewards.grading import get_grader
from vlrft.rewards.registry import reward
from vlrft.rewards.text import choice_letter, find_answer, last_number, normalize
from vlrft.rewards.types import RewardSampleError

logger = logging.getLogger(__name__)


def _looks_mathematical(reference: str) -> bool:
    return any(ch.isdigit() or ch in "\\^_{}=/" for ch in reference)


def _score_answers(
    completions: list[str], references: list[str | None], use_math: Callable[[str], bool]
) -> list[float | None]:
    """Normalised string equality first (cheap); then math-verify equivalence where `use_math(reference)`."""
    scores: list[float | None] = [None] * len(completions)
    pending: list[int] = []
    pairs: list[tuple[str, bool, str]] = []
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if reference is None or str(reference).strip() == "":
            continue
        reference = str(reference).strip()
        answer, marked = find_answer(completion)
        if normalize(answer) == normalize(reference):
            scores[i] = 1.0
        elif use_math(reference):
            pending.append(i)
            pairs.append((answer, marked, reference))
        else:
            scores[i] = 0.0
    graded = get_grader().grade(pairs)
    for i, correct in zip(pending, graded):
        scores[i] = None if correct is None else 1.0 if correct else 0.0  # None: not graded in time
    skipped = graded.count(None)
    if skipped:
        logger.warning("%d of %d math answers were not graded before the batch's deadline (reward.timeout_s); they "
                       "count as not applicable (raise reward.timeout_s or reward.grader_processes)",
                       skipped, len(graded))
    return scores


@reward("accuracy")
def accuracy(completions: list[str], references: list[str | None]) -> list[float | None]:
    """Correct final answer: normalised text match ("Red." == "red"), else math equivalence (math-verify)
    when the reference looks mathematical (has a digit or LaTeX)."""
    return _score_answers(completions, references, _looks_mathematical)


@reward("math_accuracy")
def math_accuracy(completions: list[str], references: list[str | None],
                  precision: list[float | None] | None = None) -> list[float | None]:
    """Mathematically equivalent final answer (math-verify: `\\frac{1}{2}` == `0.5`, `3\\sqrt{2}` == `\\sqrt{18}`).

    A sample with a `precision` column (decimal places, as MathVista's rows carry) and a numeric reference is
    graded as MathVista grades it: the final answer's last number rounded to that many places equals the reference
    ("1.52" is right for 1.5 at precision 1)."""
    rounded: dict[int, float] = {}
    for i, reference in enumerate(references):
        places = _places(precision[i] if precision is not None else None)
        expected = _number(reference)
        if places is None or expected is None:
            continue
        got = last_number(find_answer(completions[i])[0])
        ok = got is not None and math.isfinite(got) and abs(round(got, places) - round(expected, places)) < 1e-9
        rounded[i] = 1.0 if ok else 0.0
    rest = [None if i in rounded else reference for i, reference in enumerate(references)]
    scores = _score_answers(completions, rest, lambda _: True)
    for i, score in rounded.items():
        scores[i] = score
    return scores


def _places(value) -> int | None:
    """A `precision` cell as decimal places (None: absent, not a number, or negative)."""
    try:
        places = float(value)
    except (TypeError, ValueError):
        return None
    return int(places) if math.isfinite(places) and places >= 0 else None


def _number(reference) -> float | None:
    try:
        value = float(str(reference).strip())
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@reward("exact_match")
def exact_match(completions: list[str], references: list[str | None]) -> list[float | None]:
    """Final answer equal to the reference after normalisation (case, whitespace, edge punctuation)."""
    return _score_answers(completions, references, lambda _: False)


def _option_letter(text: str, choices: list | None) -> str | None:
    """The option letter `text` names: a letter (see `choice_letter`), or, with `choices`, an option's text."""
    letter = choice_letter(text)
    if letter is not None and (not choices or ord(letter) - ord("A") < len(choices)):
        return letter
    if choices:
        answer = normalize(find_answer(text)[0])
        for k, option in enumerate(choices):
            if normalize(str(option)) == answer:
                return chr(ord("A") + k)
    return letter


@reward("choice")
def choice(
    completions: list[str], references: list[str | None], choices: list[list | None] | None = None
) -> list[float | None]:
    """Multiple choice: the chosen option (`<answer>B</answer>`, `\\boxed{(B)}`, "the answer is B", or, when the
    dataset has a `choices` column, an option's text such as `<answer>45°</answer>`) equals the reference
    (a letter, or an option's text)."""
    scores: list[float | None] = []
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if reference is None or str(reference).strip() == "":
            scores.append(None)
            continue
        options = list(choices[i]) if choices is not None and choices[i] is not None else None
        expected = _option_letter(str(reference), options)
        if expected is None:
            raise RewardSampleError(
                i, f"choice: reference {str(reference)[:40]!r} is not an option letter such as 'B'"
                + (" nor one of the sample's choices" if options else "")
                + "; use this reward only for multiple-choice samples (route others with reward.recipes)",
            )
        scores.append(1.0 if _option_letter(completion, options) == expected else 0.0)
    return scores


@reward("numeric")
def numeric(
    completions: list[str], references: list[str | None], abs_tol: float = 0.0, rel_tol: float = 0.0
) -> list[float | None]:
    """The last number of the final answer (digits or a word zero..twenty) equals the reference number
    within max(abs_tol, rel_tol * |reference|); for counting and measuring questions."""
    scores: list[float | None] = []
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if reference is None or str(reference).strip() == "":
            scores.append(None)
            continue
        expected = last_number(str(reference))
        if expected is None:
            raise RewardSampleError(i, f"numeric: reference {str(reference)[:40]!r} has no number; give numbers like '3' or '2.5'")
        got = last_number(find_answer(completion)[0])
        ok = got is not None and math.isfinite(got) and abs(got - expected) <= max(abs_tol, rel_tol * abs(expected))
        scores.append(1.0 if ok else 0.0)
    return scores

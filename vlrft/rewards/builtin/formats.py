"""Format reward: does the completion follow the requested answer layout? 1.0 or 0.0, never None."""

from __future__ import annotations

from vlrft.rewards.registry import reward
from vlrft.rewards.text import last_boxed, tagged


def _think_answer(text: str) -> bool:
    """Exactly `<think>...</think><answer>...</answer>` (whitespace around and between), answer not empty."""
    t = text.strip()
    if not (t.startswith("<think>") and t.endswith("</answer>")):
        return False
    if any(t.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return False
    think_end, answer_start = t.find("</think>"), t.find("<answer>")
    return think_end < answer_start and not t[think_end + 8 : answer_start].strip() and bool(t[answer_start + 8 : -9].strip())


def _think_boxed(text: str) -> bool:
    """`<think>...</think>` first, then text holding a non-empty `\\boxed{...}`."""
    t = text.strip()
    if not t.startswith("<think>") or t.count("<think>") != 1 or t.count("</think>") != 1:
        return False
    boxed = last_boxed(t[t.find("</think>") :])
    return bool(boxed and boxed.strip())


def _answer(text: str) -> bool:
    """One non-empty `<answer>...</answer>` block with nothing after it."""
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    content = tagged(text, "answer")
    return bool(content and content.strip()) and not text[text.rfind("</answer>") + 9 :].strip()


def _boxed(text: str) -> bool:
    boxed = last_boxed(text)
    return bool(boxed and boxed.strip())


FORMAT_STYLES = {"think_answer": _think_answer, "think_boxed": _think_boxed, "answer": _answer, "boxed": _boxed}


@reward("format")
def format_reward(completions: list[str], style: str = "think_answer") -> list[float]:
    """1.0 when the completion has the layout `style`: think_answer (`<think>…</think><answer>…</answer>`),
    think_boxed (`<think>…</think>` then `\\boxed{…}`), answer (one `<answer>` block at the end) or boxed."""
    check = FORMAT_STYLES.get(style)
    if check is None:
        raise ValueError(f"format: unknown style {style!r}; use one of {', '.join(FORMAT_STYLES)}")
    return [1.0 if check(c) else 0.0 for c in completions]

"""Grounding reward: intersection-over-union of the predicted box with the reference box."""

from __future__ import annotations

from vlrft.rewards.registry import reward
from vlrft.rewards.text import find_answer, last_box
from vlrft.rewards.types import RewardSampleError


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """IoU of two [x1, y1, x2, y2] boxes; 0.0 when either box is empty or inverted."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


@reward("iou")
def iou(completions: list[str], references: list[str | None], threshold: float | None = None) -> list[float | None]:
    """IoU of the last box in the final answer (`[x1, y1, x2, y2]` or `(x1,y1),(x2,y2)`) with the reference box;
    with `threshold`, 1.0 when IoU >= threshold else 0.0. No box in the completion scores 0.0."""
    scores: list[float | None] = []
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if reference is None or str(reference).strip() == "":
            scores.append(None)
            continue
        expected = last_box(str(reference))
        if expected is None:
            raise RewardSampleError(i, f"iou: reference {str(reference)[:60]!r} is not a box; write it as '[x1, y1, x2, y2]'")
        got = last_box(find_answer(completion)[0])
        value = box_iou(got, expected) if got is not None else 0.0
        scores.append(value if threshold is None else float(value >= threshold))
    return scores

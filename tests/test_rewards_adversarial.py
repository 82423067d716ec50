"""Completions are untrusted: grading hostile text must finish in bounded time and memory and score 0."""

from __future__ import annotations

import random
import resource
import string
import time

import pytest

from vlrft.config import RewardConfig
from vlrft.config import RewardFunctionConfig as F
from vlrft.rewards import RewardSet
from vlrft.rewards.builtin.answers import choice, exact_match, numeric
from vlrft.rewards.builtin.formats import FORMAT_STYLES, format_reward
from vlrft.rewards.builtin.grounding import iou
from vlrft.rewards.grading import GraderSettings, MathGrader

_rng = random.Random(0)
GARBAGE = "".join(_rng.choice(string.printable) for _ in range(1_000_000))  # 1 MB, braces and backslashes included

HOSTILE = {
    "power_tower": "9**9**9**9",
    "boxed_power_tower": "\\boxed{9^{9^{9^{9}}}}",
    "nested_frac": "\\frac{" * 5000,
    "boxed_nested_frac": "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5001,
    "boxed_huge_factorial": "<answer>(10^{10})!</answer>",
    "garbage_1mb": GARBAGE,
    "open_braces_1mb": "\\boxed{" + "{" * 1_000_000,
    "answer_tags_1mb": "<answer>" * 120_000 + "</answer>" * 3,
    "box_prefixes_1mb": "[1," * 330_000,
    "answer_is_1mb": "the answer is " * 75_000,
    "digits_1mb": "1," * 500_000 + "9" * 5000,
}


@pytest.fixture(scope="module")
def math_set():
    return RewardSet.from_config(RewardConfig(
        functions=[F("math_accuracy"), F("accuracy")], timeout_s=10, grader_processes=2, grader_timeout_s=4,
    ))


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.slow
def test_math_grading_of_hostile_completion_is_bounded(math_set, name):
    start = time.perf_counter()
    result = math_set.score([HOSTILE[name], "\\boxed{\\frac{1}{2}}"], references=["7", "0.5"])
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"{name}: {elapsed:.1f} s"
    assert result.per_function["math_accuracy"].tolist() == [0.0, 1.0]  # the honest answer next to it still counts
    assert result.per_function["accuracy"].tolist() == [0.0, 1.0]


def test_rule_rewards_on_hostile_completions_are_fast():
    references = {"choice": "B", "numeric": "7", "iou": "[0, 0, 10, 10]", "exact_match": "red"}
    functions = {"choice": choice, "numeric": numeric, "iou": iou, "exact_match": exact_match}
    for name, completion in HOSTILE.items():
        for fn_name, fn in functions.items():
            start = time.perf_counter()
            assert fn([completion], [references[fn_name]]) == [0.0], (name, fn_name)
            assert time.perf_counter() - start < 2, (name, fn_name)
        for style in FORMAT_STYLES:
            start = time.perf_counter()
            assert format_reward([completion], style=style)[0] in (0.0, 1.0)  # a well-formed \boxed{9^{9^{9^9}}} is boxed
            assert time.perf_counter() - start < 2, (name, style)
    assert format_reward([HOSTILE["garbage_1mb"], HOSTILE["answer_tags_1mb"]], style="think_answer") == [0.0, 0.0]


@pytest.mark.slow
def test_worker_that_overruns_is_killed_and_replaced():
    """No alarm inside the worker (step timeout 30 s): only the parent's kill can stop this factorial."""
    grader = MathGrader(GraderSettings(processes=1, timeout_s=1.0, step_timeout_s=30))
    try:
        start = time.perf_counter()
        assert grader.grade([("(10^{10})!", True, "1")]) == [False]
        assert time.perf_counter() - start < 10
        assert grader.kills == 1
        assert grader.grade([("\\frac{1}{2}", True, "0.5")]) == [True]  # a fresh worker took over
    finally:
        grader.close()


@pytest.mark.slow
def test_a_batch_of_slow_answers_stops_taking_up_answers_at_its_deadline():
    """Early in training many answers are degenerate and each runs to the per-answer limit; a few workers then
    need longer for the batch than the reward's own timeout, and the queued answers would delay the next
    batch. Answers no worker took up within batch_timeout_s are not graded (None); the others are."""
    grader = MathGrader(GraderSettings(processes=1, timeout_s=1.0, step_timeout_s=30, batch_timeout_s=1.5))
    try:
        grader.grade([("1", True, "1")])  # the worker is up (its start is not what is measured)
        slow = ("(10^{10})!", True, "1")
        start = time.perf_counter()
        results = grader.grade([slow] * 6 + [("\\frac{1}{2}", True, "0.5")])
        elapsed = time.perf_counter() - start
        assert results[0] is False and results[-1] is None and results.count(None) >= 4
        assert elapsed < 6, elapsed  # without the deadline: 6 kills of 1 s each, plus the restarts
    finally:
        grader.close()


@pytest.mark.slow
def test_workers_run_under_the_memory_limit_and_the_trainer_does_not_grow():
    grader = MathGrader(GraderSettings(processes=1, timeout_s=4, memory_mb=768))
    try:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert grader.grade([("2^{2^{40}}", True, "1"), ("10^{10^{9}}", True, "1"), ("1", True, "1")]) == [False, False, True]
        pid = grader._workers[0].proc.pid
        with open(f"/proc/{pid}/limits") as f:
            limit = next(line for line in f if line.startswith("Max address space")).split()[3]
        assert int(limit) == 768 * 2**20
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        assert grown_mb < 100, f"the calling process grew by {grown_mb:.0f} MB"
    finally:
        grader.close()

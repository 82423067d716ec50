"""Built-in rewards on completions the way models write them."""

from __future__ import annotations

import pytest

from vlrft.config import RewardConfig
from vlrft.config import RewardFunctionConfig as F
from vlrft.rewards import RewardError, RewardSet
from vlrft.rewards.builtin.answers import accuracy, choice, exact_match, math_accuracy, numeric
from vlrft.rewards.builtin.formats import format_reward
from vlrft.rewards.builtin.grounding import iou
from vlrft.rewards.text import extract_answer, last_boxed


def test_accuracy_on_the_demo_color_answers():
    completions = ["red", "Red.", "<answer>red</answer>", "<think>The shape is filled with red.</think> <answer> Red </answer>",
                   "blue", "<answer>blue</answer> but maybe red", "The color is red.", ""]
    assert accuracy(completions, ["red"] * len(completions)) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_accuracy_is_none_without_a_reference():
    assert accuracy(["red", "red"], [None, ""]) == [None, None]


def test_accuracy_grades_math_answers_by_value():
    completions = [
        "<think>Half of the area.</think><answer>\\frac{1}{2}</answer>",
        "The side is 3\\sqrt{2}, so the answer is \\boxed{3\\sqrt{2}}.",
        "Adding them up gives a total of 12.",
        "\\boxed{13}",
        "<answer>x = 4</answer>",
    ]
    references = ["0.5", "\\sqrt{18}", "12", "12", "4"]
    assert accuracy(completions, references) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_math_accuracy_and_exact_match_differ_on_equivalent_forms():
    completions = ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "<answer>1/3</answer>"]
    references = ["0.5", "0.5", "0.5"]
    assert math_accuracy(completions, references) == [1.0, 1.0, 0.0]
    assert exact_match(completions, references) == [0.0, 1.0, 0.0]


def test_choice_reads_the_letter_in_its_usual_forms():
    completions = [
        "<think>Angle ABC is 45 degrees.</think><answer>B</answer>",
        "\\boxed{(C)}",
        "Comparing the options, the answer is (A).",
        "<answer>B. 45°</answer>",
        "A circle is drawn in the picture.",
        "<answer>D</answer>",
        "d",
    ]
    references = ["B", "C", "A", "(B)", "A", "B", "D"]
    assert choice(completions, references) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_choice_rejects_a_reference_that_is_not_a_letter_naming_the_function():
    rs = RewardSet.from_config(RewardConfig(functions=[F("choice")]))
    with pytest.raises(RewardError, match=r"'choice' failed on sample 1 \(step 0\): choice: reference '42' is not an option letter"):
        rs.score(["B", "B"], references=["B", "42"])


def test_numeric_counts_and_measures():
    completions = ["There are three circles.", "<answer>3.0</answer>", "<answer>1,234</answer>",
                   "I count 2 squares and 4 circles, so 6 shapes.", "no idea", "<answer>10.4</answer>"]
    references = ["3", "3", "1234", "6", "6", "10"]
    assert numeric(completions, references) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert numeric(["<answer>10.4</answer>"], ["10"], abs_tol=0.5) == [1.0]
    assert numeric(["<answer>10.4</answer>"], ["10"], rel_tol=0.01) == [0.0]  # 0.4 > 0.01 * 10
    assert numeric(["<answer>10.05</answer>"], ["10"], rel_tol=0.01) == [1.0]


@pytest.mark.parametrize("completion, expected", [
    ("<think>The shape has three sides.</think><answer>triangle</answer>", 1.0),
    ("<think>\nreasoning\n</think>\n<answer>\ntriangle\n</answer>\n", 1.0),
    ("<think>x</think><answer></answer>", 0.0),  # empty answer
    ("<answer>triangle</answer>", 0.0),  # no thinking
    ("<think>x</think>Some words<answer>triangle</answer>", 0.0),  # text between the blocks
    ("<think>x</think><answer>triangle</answer> extra", 0.0),  # text after the answer
    ("<think>a</think><think>b</think><answer>triangle</answer>", 0.0),  # repeated block
    ("<answer>triangle</answer><think>x</think>", 0.0),  # wrong order
])
def test_format_think_answer(completion, expected):
    assert format_reward([completion]) == [expected]


def test_format_other_styles():
    assert format_reward(["<think>sum 5+7</think> So the total is \\boxed{12}.", "<think>x</think> 12"], style="think_boxed") == [1.0, 0.0]
    assert format_reward(["It is red. <answer>red</answer>", "<answer>red</answer> ok"], style="answer") == [1.0, 0.0]
    assert format_reward(["\\boxed{12}", "\\boxed{}", "\\boxed{12"], style="boxed") == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown style 'xml'"):
        format_reward(["a"], style="xml")


def test_iou_of_boxes_in_common_notations():
    completions = [
        "<answer>[0, 0, 10, 10]</answer>",
        "The dog is at <|box_start|>(0,0),(10,10)<|box_end|>",
        "<answer>[5, 5, 15, 15]</answer>",
        "<answer>[20, 20, 30, 30]</answer>",
        "<answer>[10, 10, 0, 0]</answer>",
        "I cannot find it.",
    ]
    scores = iou(completions, ["[0, 0, 10, 10]"] * len(completions))
    # [5,5,15,15] vs [0,0,10,10]: intersection 5*5 = 25, union 100 + 100 - 25 = 175
    assert scores == pytest.approx([1.0, 1.0, 25 / 175, 0.0, 0.0, 0.0])
    assert iou(completions[:3], ["[0, 0, 10, 10]"] * 3, threshold=0.5) == [1.0, 1.0, 0.0]


def test_iou_rejects_a_reference_that_is_not_a_box():
    with pytest.raises(ValueError, match=r"iou: reference 'left' is not a box"):
        iou(["[0,0,1,1]"], ["left"])


def test_answer_extraction_rules():
    assert extract_answer("<think>maybe \\boxed{1}</think><answer>The value is \\boxed{2}</answer>") == "2"
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert extract_answer("<answer>a</answer> retry <answer>b</answer>") == "b"
    assert extract_answer("no markup at all") == "no markup at all"
    assert last_boxed("\\boxed{a \\{ b \\} c}") == "a \\{ b \\} c"
    assert last_boxed("\\boxed{unclosed") is None


def test_builtins_through_a_reward_set_with_weights():
    rs = RewardSet.from_config(RewardConfig(functions=[F("accuracy"), F("format", weight=0.5)]))
    result = rs.score(["<think>It is red.</think><answer>red</answer>", "red", "<think>x</think><answer>blue</answer>"],
                      references=["red", "red", "red"])
    assert result.total.tolist() == [1.5, 1.0, 0.5]

"""The reward API contract: arguments, None and weights, label routing, concurrency, timeouts, bad results, loading."""

from __future__ import annotations

import asyncio
import math
import textwrap
import time
from pathlib import Path

import pytest
import torch

from vlrft.config import RewardConfig
from vlrft.config import RewardFunctionConfig as F
from vlrft.errors import ConfigError, UserError
from vlrft.rewards import RewardError, RewardSet, reward, reward_metrics, stats_from_tensor, stats_to_tensor

DATA = Path(__file__).parent / "data"
NAN = float("nan")


def make_set(functions, recipes=None, **options) -> RewardSet:
    return RewardSet.from_config(RewardConfig(functions=functions, recipes=recipes or {}, **options))


def values(t: torch.Tensor) -> list:
    """Tensor -> list with None for NaN (NaN != NaN, so compare this way)."""
    return [None if math.isnan(v) else pytest.approx(v) for v in t.tolist()]


# Functions registered the way users register theirs.
CALLS: list[tuple[str, list[str], dict]] = []


@reward("test_record")
def fn_record(completions, **kwargs):
    CALLS.append(("test_record", list(completions), kwargs))
    return [float(len(c)) for c in completions]


@reward("test_some_none")
def fn_some_none(completions, **kwargs):
    return [{"x": 1.0, "y": None, "z": 0.5, "w": None}[c] for c in completions]


@reward("test_other_none")
def fn_other_none(completions, **kwargs):
    return [{"x": 0.2, "y": 0.4, "z": None, "w": None}[c] for c in completions]


@reward("test_one")
def fn_one(completions):
    CALLS.append(("test_one", list(completions), {}))
    return [1.0] * len(completions)


@reward("test_two")
def fn_two(completions):
    CALLS.append(("test_two", list(completions), {}))
    return [2.0] * len(completions)


@reward("test_async_sleep")
async def fn_async_sleep(completions, seconds: float = 0.5):
    await asyncio.sleep(seconds)
    return [1.0] * len(completions)


@reward("test_sync_sleep")
def fn_sync_sleep(completions, seconds: float = 0.5):
    time.sleep(seconds)
    return [1.0] * len(completions)


@reward("test_returns")
def fn_returns(completions, value=None, length: int | None = None):
    """Returns `value` for the second completion (and 0.0 for the others), or `length` zeros."""
    if length is not None:
        return [0.0] * length
    return [value if i == 1 else 0.0 for i in range(len(completions))]


@reward("test_raises")
def fn_raises(completions):
    raise ValueError("boom")


@reward("test_exits")
def fn_exits(completions):
    import sys

    sys.exit(3)


@reward("test_interrupts")
def fn_interrupts(completions):
    raise KeyboardInterrupt


@reward("test_async_exits")
async def fn_async_exits(completions):
    raise SystemExit("no more")


@reward("test_out_of_memory")
def fn_out_of_memory(completions):
    # A reward model's CUDA out-of-memory error, injected: it cannot happen on CPU.
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")


@reward("test_needs_difficulty")
def fn_needs_difficulty(completions, difficulty):
    return [float(d) for d in difficulty]


def test_function_gets_completions_and_every_documented_argument():
    CALLS.clear()
    rs = make_set([F("test_record")])
    image = object()
    result = rs.score(
        ["ab", "cde"], prompts=["p0", "p1"], completion_ids=[[1, 2], [3]], images=[[image], []],
        references=["r0", None], labels=["l0", None], extras=[{"difficulty": 3}, {"difficulty": 1, "source": "x"}], step=7,
    )
    assert values(result.total) == [2.0, 3.0]
    (name, completions, kwargs), = CALLS
    assert completions == ["ab", "cde"]
    assert kwargs == {
        "prompts": ["p0", "p1"], "completion_ids": [[1, 2], [3]], "images": [[image], []], "references": ["r0", None],
        "labels": ["l0", None], "difficulty": [3, 1], "source": [None, "x"], "step": 7,
    }


def test_function_declaring_only_what_it_needs_gets_only_that():
    CALLS.clear()
    result = make_set([F("test_one")]).score(["a"], references=["b"], extras=[{"col": 1}])
    assert values(result.total) == [1.0] and CALLS == [("test_one", ["a"], {})]


def test_total_is_weighted_sum_over_functions_that_returned_a_value():
    rs = make_set([F("test_some_none", weight=1.0), F("test_other_none", weight=0.5)])
    result = rs.score(["x", "y", "z", "w"])
    # x: 1*1.0 + 0.5*0.2; y: only the second applies; z: only the first; w: none applied -> NaN
    assert values(result.total) == [1.1, 0.2, 0.5, None]
    assert values(result.per_function["test_some_none"]) == [1.0, None, 0.5, None]
    assert values(result.per_function["test_other_none"]) == [0.2, 0.4, None, None]
    assert result.applicable.tolist() == [True, True, True, False]
    m = result.metrics
    assert m["reward/test_some_none/mean"] == pytest.approx(0.75)  # (1 + 0.5) / 2
    assert m["reward/test_some_none/std"] == pytest.approx(0.25)  # population std of {1, 0.5}
    assert m["reward/test_some_none/frac_none"] == pytest.approx(0.5)
    assert m["reward/test_other_none/mean"] == pytest.approx(0.3)
    assert m["reward/test_other_none/std"] == pytest.approx(0.1)
    assert m["reward/total/mean"] == pytest.approx(0.6)  # (1.1 + 0.2 + 0.5) / 3
    assert m["reward/total/std"] == pytest.approx(math.sqrt((1.21 + 0.04 + 0.25) / 3 - 0.36))
    assert m["reward/total/frac_none"] == pytest.approx(0.25)
    assert m["reward/test_some_none/errors"] == 0


def test_label_picks_recipe_and_each_function_runs_once_on_its_samples():
    CALLS.clear()
    rs = make_set(
        [F("test_one", weight=1.0)],
        recipes={"math": [F("test_two", weight=0.5)], "mixed": [F("test_one", weight=3.0), F("test_two", weight=-1.0)],
                 "unscored": []},
    )
    labels = ["math", None, "mixed", "other", "unscored", "math"]
    result = rs.score(list("abcdef"), labels=labels)
    # math: 0.5*2; no label and unknown label: default 1*1; mixed: 3*1 - 1*2; unscored: nothing applies
    assert values(result.total) == [1.0, 1.0, 1.0, 1.0, None, 1.0]
    assert values(result.per_function["test_one"]) == [None, 1.0, 1.0, 1.0, None, None]
    assert values(result.per_function["test_two"]) == [2.0, None, 2.0, None, None, 2.0]
    assert sorted((name, tuple(c)) for name, c, _ in CALLS) == [("test_one", ("b", "c", "d")), ("test_two", ("a", "c", "f"))]
    assert result.stats["test_two"].count == 3 and result.stats["test_two"].not_applicable == 0
    assert result.stats["total"].not_applicable == 1


def test_unroutable_label_is_an_error_naming_sample_and_label():
    rs = make_set([], recipes={"math": [F("test_one")]})
    with pytest.raises(RewardError, match=r"sample 1 has label 'geo'.*reward.recipes.geo"):
        rs.score(["a", "b"], labels=["math", "geo"])


def test_async_functions_run_concurrently():
    rs = make_set([F("test_async_sleep", alias="a"), F("test_async_sleep", alias="b")])
    start = time.perf_counter()
    result = rs.score(["x", "y"])
    elapsed = time.perf_counter() - start
    assert values(result.total) == [2.0, 2.0]
    assert elapsed < 0.9, f"two 0.5 s async rewards took {elapsed:.2f} s: they did not overlap"


def test_sync_functions_run_concurrently_in_threads_and_max_concurrency_limits_them():
    both = [F("test_sync_sleep", alias="a"), F("test_sync_sleep", alias="b")]
    start = time.perf_counter()
    make_set(both).score(["x"])
    assert time.perf_counter() - start < 0.9
    start = time.perf_counter()
    make_set(both, max_concurrency=1).score(["x"])
    assert time.perf_counter() - start >= 1.0


@pytest.mark.parametrize("name", ["test_async_sleep", "test_sync_sleep"])
def test_timeout_names_function_and_samples_and_returns_promptly(name):
    rs = make_set([F(name, kwargs={"seconds": 5.0})], timeout_s=0.3)
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"'{name}' did not finish within reward.timeout_s=0.3 s on samples 0-1"):
        rs.score(["a", "b"])
    assert time.perf_counter() - start < 2.0


def test_a_hung_sync_function_holds_one_thread_and_is_not_called_again_until_it_ends():
    """A sync reward thread cannot be stopped after a timeout. Starting another at every step would leak one
    thread (and whatever it holds) per step; while the timed-out call runs, the function is not called again and
    its samples count as errors."""
    import threading

    rs = make_set([F("test_sync_sleep", alias="hung", kwargs={"seconds": 1.5}), F("test_one")], timeout_s=0.2,
                  on_error="none")

    def reward_threads() -> int:
        return sum(t.name == "vlrft-reward-hung" and t.is_alive() for t in threading.enumerate())

    first = rs.score(["a", "b"])
    assert "did not finish" in first.error_messages[0] and reward_threads() == 1
    for _ in range(3):  # the next steps, while the first call still sleeps
        later = rs.score(["a", "b"])
        assert values(later.per_function["hung"]) == [None, None]
        assert "is still running" in later.error_messages[0]
        assert values(later.per_function["test_one"]) == [1.0, 1.0]
    assert reward_threads() == 1
    time.sleep(1.6)  # the hung call ends: the function is called again (and times out again)
    assert "did not finish" in rs.score(["a"]).error_messages[0]


def test_timeout_with_on_error_none_counts_samples_as_not_applicable():
    rs = make_set([F("test_sync_sleep", kwargs={"seconds": 5.0}), F("test_one", weight=2.0)], timeout_s=0.3, on_error="none")
    result = rs.score(["a", "b"])
    assert values(result.total) == [2.0, 2.0]
    assert values(result.per_function["test_sync_sleep"]) == [None, None]
    assert result.metrics["reward/test_sync_sleep/errors"] == 2
    assert result.metrics["reward/test_sync_sleep/frac_none"] == 1.0
    assert result.metrics["reward/total/errors"] == 2
    assert "did not finish" in result.error_messages[0]


def test_a_reward_function_out_of_device_memory_is_told_to_lower_its_batch_size():
    with pytest.raises(RewardError, match=r"'test_out_of_memory' ran out of device memory on samples 0-1 \(step 2\): "
                                          r"CUDA out of memory. Tried to allocate 8.00 GiB; lower its batch size "
                                          r"\(the built-in reward_model: kwargs batch_size and max_length\)"):
        make_set([F("test_out_of_memory")]).score(["a", "b"], step=2)


def test_exception_names_function_type_message_and_samples():
    with pytest.raises(RewardError, match=r"'test_raises' raised ValueError: boom \(on samples 0-2, step 4\)"):
        make_set([F("test_raises")]).score(["a", "b", "c"], step=4)
    result = make_set([F("test_raises"), F("test_one")], on_error="none").score(["a", "b", "c"])
    assert values(result.total) == [1.0, 1.0, 1.0]
    assert result.stats["test_raises"].errors == 3


@pytest.mark.parametrize("name, said", [("test_exits", r"called sys\.exit\(3\)"),
                                        ("test_interrupts", "raised KeyboardInterrupt"),
                                        ("test_async_exits", r"called sys\.exit\('no more'\)")])
def test_a_reward_that_exits_is_a_one_line_error_naming_it_or_follows_on_error(name, said):
    """sys.exit(3) or a KeyboardInterrupt inside a reward went through asyncio as they are: the run ended with a
    SystemExit traceback (exit code 3) or a KeyboardInterrupt one (130) that did not name the function."""
    with pytest.raises(RewardError, match=rf"^reward function '{name}' {said} on samples 0-1 \(step 5\); return the "
                                          r"scores .* or set reward.on_error=none"):
        make_set([F(name)]).score(["a", "b"], step=5)
    result = make_set([F(name), F("test_one")], on_error="none").score(["a", "b"])
    assert values(result.total) == [1.0, 1.0] and result.stats[name].errors == 2
    assert values(make_set([F("test_one")]).score(["c"]).total) == [1.0]  # the process and its event loops go on


def test_wrong_length_is_an_error():
    rs = make_set([F("test_returns", kwargs={"length": 2})])
    with pytest.raises(RewardError, match=r"'test_returns' returned 2 values for 3 completions \(samples 0-2\)"):
        rs.score(["a", "b", "c"])


@pytest.mark.parametrize(
    "value, pattern",
    [(NAN, r"returned nan for sample 3"), (float("inf"), r"returned inf for sample 3"), ("0.5", r"returned a str \('0.5'\) for sample 3")],
)
def test_bad_value_names_the_global_sample_index(value, pattern):
    # Routed samples 1 and 3 reach the function; its second value belongs to sample 3 of the batch.
    rs = make_set([F("test_one")], recipes={"t": [F("test_returns", kwargs={"value": value})]})
    with pytest.raises(RewardError, match=pattern):
        rs.score(list("abcd"), labels=[None, "t", None, "t"])


def test_bad_value_with_on_error_none_loses_only_that_sample():
    rs = make_set([F("test_returns", kwargs={"value": NAN})], on_error="none")
    result = rs.score(["a", "b", "c"])
    assert values(result.total) == [0.0, None, 0.0]
    assert result.stats["test_returns"].errors == 1 and result.stats["test_returns"].count == 2


def test_tensor_and_numpy_results_are_accepted():
    import numpy as np

    @reward("test_tensor_result")
    def tensor_result(completions):
        return torch.tensor([0.5] * len(completions))

    @reward("test_numpy_result")
    def numpy_result(completions):
        return np.array([0.25] * len(completions))

    result = make_set([F("test_tensor_result"), F("test_numpy_result")]).score(["a", "b"])
    assert values(result.total) == [0.75, 0.75]


def test_a_number_no_float_holds_is_a_counted_reward_error():
    """10**400 (a Python int) overflowed float(): a traceback even with on_error=none."""
    with pytest.raises(RewardError, match=r"'test_returns' returned a number too large for a float \(about 10\^400\) "
                                          r"for sample 1"):
        make_set([F("test_returns", kwargs={"value": 10**400})]).score(["a", "b", "c"])
    result = make_set([F("test_returns", kwargs={"value": -10**5000})], on_error="none").score(["a", "b", "c"])
    assert values(result.total) == [0.0, None, 0.0]
    assert result.stats["test_returns"].errors == 1


def test_numpy_and_tensor_scalars_count_as_the_numbers_they_hold():
    """One rule: a value is the Python number it holds. np.bool_ was refused ("returned a bool_") while Python bools
    and numpy bool arrays (whose tolist() gives Python bools) were accepted."""
    import numpy as np

    for value, expected in ((np.bool_(True), 1.0), (np.float32(0.5), 0.5), (np.int64(3), 3.0), (True, 1.0),
                            (torch.tensor(0.25), 0.25)):
        result = make_set([F("test_returns", kwargs={"value": value})]).score(["a", "b"])
        assert values(result.total) == [0.0, expected], value

    @reward("test_numpy_bools")
    def numpy_bools(completions):
        return [np.bool_(len(c) > 1) for c in completions]

    @reward("test_numpy_bool_array")
    def numpy_bool_array(completions):
        return np.array([len(c) > 1 for c in completions])

    result = make_set([F("test_numpy_bools"), F("test_numpy_bool_array")]).score(["a", "bb"])
    assert values(result.total) == [0.0, 2.0]
    with pytest.raises(RewardError, match=r"returned a ndarray"):  # an array per sample is still not a number
        make_set([F("test_returns", kwargs={"value": np.array([1.0, 2.0])})]).score(["a", "b"])


def test_missing_column_is_named_and_dataset_column_is_passed():
    rs = make_set([F("test_needs_difficulty")])
    with pytest.raises(RewardError, match=r"needs argument\(s\) \['difficulty'\].*dataset columns \(source\)"):
        rs.score(["a"], extras=[{"source": "x"}])
    assert values(rs.score(["a", "b"], extras=[{"difficulty": 2}, {"difficulty": 0.5}]).total) == [2.0, 0.5]


def test_module_function_and_file_function_specs(tmp_path, monkeypatch):
    (tmp_path / "my_team_rewards.py").write_text("def brevity(completions, **kw):\n    return [1.0 / len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rs = make_set([F("my_team_rewards:brevity"), F(f"{DATA / 'user_rewards.py'}:length_bonus", weight=2.0)])
    result = rs.score(["abcd", "abcdefghijklmnop"])
    assert sorted(result.per_function) == ["brevity", "length_bonus"]
    assert values(result.total) == [0.25 + 2 * 0.4, 1 / 16 + 2 * 1.0]
    monkeypatch.chdir(DATA.parent.parent)
    relative = make_set([F("tests/data/user_rewards.py:length_bonus")])  # relative to the working directory
    assert values(relative.score(["abc"]).total) == [0.3]


def test_file_function_using_dataset_columns():
    rs = make_set([F(f"{DATA / 'user_rewards.py'}:difficulty_weighted")])
    result = rs.score(["red", "red"], references=["red", "blue"], extras=[{"difficulty": 3.0}, {"difficulty": 2.0}])
    assert values(result.total) == [3.0, 0.0]


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("no_such_reward", r"'no_such_reward' is not registered; expected one of: .*accuracy"),
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'"),
        ("vlrft.rewards.builtin.answers:nope", r"has no attribute 'nope'"),
        ("missing/file.py:fn", r"file '.*missing/file.py' not found"),
    ],
)
def test_bad_function_names_are_config_errors(name, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_set([F(name)])


def test_decorator_rejects_a_different_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        reward("test_one")(lambda completions: [0.0] * len(completions))


def test_registered_class_is_built_once_with_config_kwargs():
    built = []

    @reward("test_scaled")
    class Scaled:
        def __init__(self, scale: float):
            built.append(scale)
            self.scale = scale

        def __call__(self, completions, **kwargs):
            return [self.scale * len(c) for c in completions]

    rs = make_set([F("test_scaled", kwargs={"scale": 0.5})])
    assert values(rs.score(["ab"]).total) == [1.0]
    assert values(rs.score(["abcd"]).total) == [2.0]
    assert built == [0.5]


def test_unknown_kwarg_lists_accepted_ones():
    with pytest.raises(ConfigError, match=r"'numeric'.*does not take kwargs \['tolerance'\]; it takes: abs_tol, rel_tol"):
        make_set([F("numeric", kwargs={"tolerance": 0.1})])


def test_same_name_with_different_kwargs_needs_an_alias():
    with pytest.raises(ConfigError, match=r"both use the key 'numeric'.*alias"):
        make_set([F("numeric"), F("numeric", kwargs={"abs_tol": 1.0})])
    rs = make_set([F("numeric", alias="numeric_exact"), F("numeric", kwargs={"abs_tol": 1.0}, alias="numeric_close")])
    result = rs.score(["<answer>10.5</answer>"], references=["10"])
    assert values(result.per_function["numeric_exact"]) == [0.0]
    assert values(result.per_function["numeric_close"]) == [1.0]


@pytest.mark.parametrize("cfg, pattern", [
    (RewardConfig(), r"reward.functions is empty"),
    (RewardConfig(functions=[F("test_one", weight=NAN)]), r"reward.functions\[0\].weight=nan"),
    (RewardConfig(functions=[F("test_one", alias="total")]), r"key 'total'"),
    (RewardConfig(functions=[F("test_one")], on_error="ignore"), r"reward.on_error='ignore'"),
    (RewardConfig(functions=[F("test_one")], grader_memory_mb=64), r"reward.grader_memory_mb=64"),
    (RewardConfig(functions=[F("test_one")], grader_timeout_s=0), r"reward.grader_timeout_s=0"),
])
def test_bad_reward_config(cfg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RewardSet.from_config(cfg)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"references": ["a"]}, r"references has 1 entries for 2 completions"),
    ({"extras": [{"prompts": 1}, {}]}, r"dataset column 'prompts' clashes"),
])
def test_bad_batch_arguments(kwargs, pattern):
    with pytest.raises(RewardError, match=pattern):
        make_set([F("test_one")]).score(["a", "b"], **kwargs)


def test_completions_must_be_text():
    with pytest.raises(RewardError, match=r"completions\[1\] is a int; pass decoded text"):
        make_set([F("test_one")]).score(["a", 3])


def test_stats_summed_over_batches_give_the_metrics_of_the_whole_batch():
    """What a trainer does across ranks: all-reduce the stats tensor, then compute metrics once."""
    rs = make_set([F("test_some_none"), F("test_other_none", weight=0.5)])
    rank0, rank1 = rs.score(["x", "y"]), rs.score(["z", "w", "x"])
    keys, t0 = stats_to_tensor(rank0.stats)
    keys1, t1 = stats_to_tensor(rank1.stats)
    assert keys == keys1 == ["test_other_none", "test_some_none", "total"]  # same keys on every rank
    reduced = reward_metrics(stats_from_tensor(keys, t0 + t1))
    whole = rs.score(["x", "y", "z", "w", "x"]).metrics
    assert reduced.keys() == whole.keys()
    for key in whole:
        assert reduced[key] == pytest.approx(whole[key]), key


def test_score_inside_an_event_loop_points_to_ascore():
    rs = make_set([F("test_one")])

    async def main():
        with pytest.raises(RuntimeError, match="ascore"):
            rs.score(["a"])
        return await rs.ascore(["a", "b"])

    assert values(asyncio.run(main()).total) == [1.0, 1.0]


def test_empty_batch():
    result = make_set([F("test_one")]).score([])
    assert result.total.shape == (0,) and result.per_function["test_one"].shape == (0,)
    assert result.metrics["reward/total/errors"] == 0


def test_reward_error_is_a_user_error():
    assert issubclass(RewardError, UserError)


def test_reward_config_fields_load_from_yaml(tmp_path):
    from vlrft.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
        reward:
          functions: [{name: accuracy}, {name: format, weight: 0.1, kwargs: {style: think_answer}}]
          recipes:
            grounding: [{name: iou, kwargs: {threshold: 0.5}, alias: iou50}]
          grader_processes: 1
    """))
    rs = RewardSet.from_config(load_config(path, validate=False).reward)
    assert rs.keys == ["accuracy", "format", "iou50"]
    result = rs.score(["<think>.</think><answer>[0,0,10,10]</answer>"], references=["[0,0,10,12]"], labels=["grounding"])
    assert values(result.total) == [1.0]  # IoU 100/120 >= 0.5


def test_worked_example_in_the_docs_gives_what_it_says(tmp_path, monkeypatch):
    import re

    doc = (Path(__file__).parents[1] / "docs" / "rewards.md").read_text()
    module = re.search(r"```python\n# my_rewards.py\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "my_rewards.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    rewards = RewardSet.from_config(RewardConfig(functions=[F("my_rewards.py:weighted_exact"), F("format", weight=0.1)]))
    result = rewards.score(["<think>It is red.</think><answer>red</answer>", "blue"],
                           references=["red", None], extras=[{"difficulty": 2.0}, {"difficulty": 1.0}])
    assert "tensor([2.1000, 0.0000])" in doc and values(result.total) == [2.1, 0.0]
    assert values(result.per_function["weighted_exact"]) == [2.0, None]

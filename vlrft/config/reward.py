"""The `reward:` section: reward functions, per-label recipes, timeouts and the math grader processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vlrft.config.checks import _fail
from vlrft.config.options import option
from vlrft.errors import ConfigError
from vlrft.registry import REWARDS


@dataclass
class RewardFunctionConfig:
    """One reward function: a built-in name, `module:function` or `path.py:function`, with a weight."""

    name: str = option("", "a built-in reward (see docs/rewards.md), 'module:function' or 'path.py:function'")
    weight: float = option(1.0, "the reward is the weighted sum of the functions' values")
    kwargs: dict[str, Any] = option(help="fixed keyword arguments (a factory class gets them once)", factory=dict)
    alias: str | None = option(None, "key in metrics and RewardResult.per_function; default: the function's name")


@dataclass
class RewardConfig:
    """Reward functions, per-label recipes, timeouts and the math grader processes."""

    functions: list[RewardFunctionConfig] = option(
        help="reward functions of every sample (list of {name, weight, kwargs, alias})", factory=list)
    recipes: dict[str, list[RewardFunctionConfig]] = option(
        help="label -> reward functions for samples with that label; other samples use reward.functions",
        factory=dict)
    timeout_s: float = option(30.0, "seconds one reward call may take before it fails (see reward.on_error)")
    on_error: Literal["raise", "none"] = option(
        "raise", "a reward function that raises or times out: 'raise' stops the run naming it, 'none' counts the "
        "reward as not applicable")
    max_concurrency: int = option(16, "reward function calls running at once", minimum=1)
    remote_url: str | None = option(None, "default URL of the 'remote' reward function (vlrft reward-server)")
    remote_api_key: str | None = option(None, "API key of the 'remote' reward; else the VLRFT_REWARD_API_KEY "
                                        "variable (never saved)", secret=True)
    # Math answers are graded (math-verify/sympy) in worker processes that are killed when they overrun:
    grader_processes: int = option(0, "math grader processes per rank; 0 = min(4, CPU cores / local ranks)", minimum=0)
    grader_timeout_s: float = option(5.0, "seconds to grade one math answer; an answer that takes longer scores 0")
    grader_memory_mb: int = option(2048, "address-space limit of each math grader process, in MB", minimum=1)

    def validate(self) -> None:
        """Timeouts and limits, and that every reward function name resolves (at load time, not mid-run)."""
        for key, ok, allowed in (
            ("timeout_s", self.timeout_s > 0, "a number of seconds > 0"),
            ("grader_timeout_s", self.grader_timeout_s > 0, "a number of seconds > 0"),
            ("max_concurrency", self.max_concurrency > 0, "a positive integer"),
            ("grader_processes", self.grader_processes >= 0, "an integer >= 0 (0 = automatic)"),
            ("grader_memory_mb", self.grader_memory_mb > 0, "a positive number of MB"),
        ):
            if not ok:
                _fail(f"reward.{key}", getattr(self, key), allowed)
        groups = [("reward.functions", self.functions)]
        groups += [(f"reward.recipes.{label}", fns) for label, fns in self.recipes.items()]
        for where, functions in groups:
            for i, fn in enumerate(functions):
                key = f"{where}[{i}].name"
                if not fn.name:
                    _fail(key, fn.name, "a reward function: a built-in name, 'module:function' or 'path.py:function'")
                try:
                    REWARDS.is_known(fn.name)
                except ConfigError as exc:
                    raise ConfigError(str(exc).replace("reward.functions[*].name", key, 1)) from None


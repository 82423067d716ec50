"""RewardSet: the configured reward functions, routed per label, run concurrently, checked and combined.

How rewards combine: sample i with label L uses the recipe `reward.recipes[L]` (or `reward.functions`
when L has no recipe). Its total is the weighted SUM over the functions of its recipe that returned a
value: `total_i = sum_f w_f * r_f(i)` over f with r_f(i) not None. Weights are not renormalised, so a
function returning None simply contributes nothing; when no function applied, the total is NaN
("not applicable"), which the advantage estimators treat as a missing reward.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlrft.daemon_calls import call_in_daemon_thread
from vlrft.errors import ConfigError, UserError
from vlrft.rewards.registry import resolve_reward
from vlrft.rewards.types import TOTAL_KEY, RewardError, RewardResult, RewardSampleError, RewardStats, reward_metrics

logger = logging.getLogger("vlrft.rewards")

# Keyword arguments every reward function may receive (lists with one entry per completion, except step).
REWARD_ARGUMENTS = ("prompts", "completion_ids", "images", "references", "labels", "step")


@dataclass
class RewardCallable:
    """One reward function ready to call: the callable, its fixed kwargs and what it accepts."""

    key: str  # name in metrics and per_function
    spec: str  # what the config named (registry name, module:function, path.py:function)
    fn: Callable[..., Any]
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)
    is_async: bool = False
    accepts: frozenset[str] | None = None  # keyword names it takes; None = it takes **kwargs
    required: frozenset[str] = frozenset()  # keywords it needs that have no default
    # threads of sync calls that timed out and may still run (a thread cannot be stopped): none is started again
    # while one lives, so a function that hangs holds one thread, not one more per step
    abandoned: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def build(cls, spec: str, kwargs: dict[str, Any], key: str, reward_config: Any = None) -> RewardCallable:
        """Resolve `spec`; a factory class is instantiated once with `kwargs` (plus `reward_config` if it takes one)."""
        target = resolve_reward(spec)
        kwargs = dict(kwargs)
        if inspect.isclass(target):
            if "reward_config" in inspect.signature(target).parameters:
                kwargs["reward_config"] = reward_config
            try:
                fn = target(**kwargs)
            except TypeError as exc:
                raise ConfigError(f"reward function {key!r} ({spec}): bad kwargs {sorted(kwargs)}: {exc}") from None
            kwargs = {}
        else:
            fn = target
        accepts, required = _signature(fn, key)
        clash = sorted(set(kwargs) & set(REWARD_ARGUMENTS))
        if clash:
            raise ConfigError(f"reward function {key!r}: kwargs {clash} clash with reward arguments the trainer passes; rename them")
        if accepts is not None and set(kwargs) - accepts:
            raise ConfigError(
                f"reward function {key!r} ({spec}) does not take kwargs {sorted(set(kwargs) - accepts)}; "
                f"it takes: {', '.join(sorted(accepts - set(REWARD_ARGUMENTS))) or 'no extra keyword arguments'}"
            )
        return cls(key, spec, fn, kwargs, _is_async(fn), accepts, required - set(kwargs))


def _signature(fn: Callable[..., Any], key: str) -> tuple[frozenset[str] | None, frozenset[str]]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: assume they take everything
        return None, frozenset()
    P = inspect.Parameter
    if not params or params[0].kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL):
        raise ConfigError(f"reward function {key!r} must take the list of completions as its first positional argument")
    rest = [p for p in params[1:] if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    required = frozenset(p.name for p in rest if p.default is P.empty)
    if any(p.kind == P.VAR_KEYWORD for p in params):
        return None, required
    return frozenset(p.name for p in rest), required


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass(frozen=True)
class WeightedReward:
    key: str
    weight: float


@dataclass
class _Outcome:
    """What one function call produced for its routed samples."""

    key: str
    indices: list[int]
    values: list[float]  # NaN = not applicable
    errors: int = 0
    messages: list[str] = field(default_factory=list)
    seconds: float = 0.0


class RewardSet:
    """Scores completions with the configured reward functions; see the module docstring for how they combine."""

    def __init__(
        self,
        callables: dict[str, RewardCallable],
        default: Sequence[WeightedReward],
        recipes: dict[str, Sequence[WeightedReward]] | None = None,
        timeout_s: float = 30.0,
        on_error: str = "raise",
        max_concurrency: int = 16,
    ):
        if on_error not in ("raise", "none"):
            raise ConfigError(f"config: reward.on_error={on_error!r} is not allowed; expected 'raise' or 'none'")
        if not timeout_s > 0:
            raise ConfigError(f"config: reward.timeout_s={timeout_s!r} is not allowed; expected a number > 0")
        if max_concurrency < 1:
            raise ConfigError(f"config: reward.max_concurrency={max_concurrency!r} is not allowed; expected an integer >= 1")
        self.callables = dict(callables)
        self.default = tuple(default)
        self.recipes = {label: tuple(r) for label, r in (recipes or {}).items()}
        self.timeout_s = float(timeout_s)
        self.on_error = on_error
        self.max_concurrency = int(max_concurrency)

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_config(cls, cfg: Any) -> RewardSet:
        """Build from a `vlrft.config.RewardConfig`; raises `ConfigError` for unknown names, clashing keys or bad weights."""
        from vlrft.rewards.grading import configure_grader

        if not cfg.grader_timeout_s > 0:
            raise ConfigError(f"config: reward.grader_timeout_s={cfg.grader_timeout_s!r} is not allowed; expected a number > 0")
        if cfg.grader_processes < 0:
            raise ConfigError(f"config: reward.grader_processes={cfg.grader_processes!r} is not allowed; expected 0 (auto) or more")
        if cfg.grader_memory_mb != 0 and cfg.grader_memory_mb < 256:
            raise ConfigError(f"config: reward.grader_memory_mb={cfg.grader_memory_mb!r} is not allowed; expected 0 (no limit) or >= 256")
        # a math batch stops taking up answers before the reward's own timeout: those left are not graded (None)
        configure_grader(processes=cfg.grader_processes, timeout_s=cfg.grader_timeout_s, memory_mb=cfg.grader_memory_mb,
                         batch_timeout_s=max(0.5 * cfg.timeout_s, cfg.timeout_s - cfg.grader_timeout_s - 1.0))
        if not cfg.functions and not cfg.recipes:
            raise ConfigError("config: reward.functions is empty; add at least one, e.g. reward.functions=[{name: accuracy}]")
        callables: dict[str, RewardCallable] = {}
        origin: dict[str, tuple[str, Any]] = {}

        def add(entries: list[Any], where: str) -> list[WeightedReward]:
            recipe: list[WeightedReward] = []
            for j, fc in enumerate(entries):
                at = f"{where}[{j}]"
                if not fc.name:
                    raise ConfigError(f"config: {at}.name is empty; give a registered name, 'module:function' or 'file.py:function'")
                if not isinstance(fc.weight, (int, float)) or not math.isfinite(fc.weight):
                    raise ConfigError(f"config: {at}.weight={fc.weight!r} is not allowed; expected a finite number")
                key = fc.alias or fc.name.rsplit(":", 1)[-1]
                if key == TOTAL_KEY or "/" in key:
                    raise ConfigError(f"config: {at} has key {key!r}, which is reserved or has '/'; set {at}.alias to another name")
                if key in origin and origin[key] != (fc.name, fc.kwargs):
                    raise ConfigError(
                        f"config: {at} ({fc.name} with kwargs {fc.kwargs}) and an earlier entry both use the key {key!r} "
                        f"with different settings; set {at}.alias to tell them apart"
                    )
                if any(w.key == key for w in recipe):
                    raise ConfigError(f"config: {at}: reward {key!r} appears twice in {where}; list it once with the summed weight")
                if key not in callables:
                    callables[key] = RewardCallable.build(fc.name, fc.kwargs, key, reward_config=cfg)
                    origin[key] = (fc.name, fc.kwargs)
                recipe.append(WeightedReward(key, float(fc.weight)))
            return recipe

        default = add(cfg.functions, "reward.functions")
        recipes = {str(label): add(entries, f"reward.recipes.{label}") for label, entries in cfg.recipes.items()}
        return cls(callables, default, recipes, cfg.timeout_s, cfg.on_error, cfg.max_concurrency)

    def __repr__(self) -> str:
        def show(recipe: Sequence[WeightedReward]) -> str:
            return " + ".join(f"{w.weight:g}*{w.key}" for w in recipe) or "(none)"

        parts = [f"default: {show(self.default)}"] + [f"{label}: {show(r)}" for label, r in self.recipes.items()]
        return f"RewardSet({'; '.join(parts)}; timeout_s={self.timeout_s:g}, on_error={self.on_error})"

    @property
    def keys(self) -> list[str]:
        """Function keys, as used in `per_function`, `stats` and the metrics."""
        return list(self.callables)

    def prepare(self) -> None:
        """Load what reward functions load once (e.g. a reward model's weights), before any scoring timeout runs."""
        for c in self.callables.values():
            prepare = getattr(c.fn, "prepare", None)
            if callable(prepare):
                prepare()

    def close(self) -> None:
        """Release what reward functions hold (e.g. a reward model's weights)."""
        for c in self.callables.values():
            close = getattr(c.fn, "close", None)
            if callable(close):
                close()

    # ------------------------------------------------------------------------------------------
    # scoring

    def score(
        self,
        completions: Sequence[str],
        *,
        prompts: Sequence[str] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        images: Sequence[Sequence[Any]] | None = None,
        references: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
        extras: Sequence[dict[str, Any] | None] | None = None,
        step: int = 0,
    ) -> RewardResult:
        """Synchronous `ascore`; call `await ascore(...)` instead from inside an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore(
                completions, prompts=prompts, completion_ids=completion_ids, images=images, references=references,
                labels=labels, extras=extras, step=step,
            ))
        raise RuntimeError("RewardSet.score was called inside a running event loop; use `await reward_set.ascore(...)` there")

    async def ascore(
        self,
        completions: Sequence[str],
        *,
        prompts: Sequence[str] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        images: Sequence[Sequence[Any]] | None = None,
        references: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
        extras: Sequence[dict[str, Any] | None] | None = None,
        step: int = 0,
    ) -> RewardResult:
        """Score N completions. All sequences are per completion; `extras[i]` holds sample i's extra dataset
        columns, passed to functions by column name. Omitted arguments default to empty values."""
        import torch

        n = len(completions)
        columns = _batch_columns(completions, prompts, completion_ids, images, references, labels, extras)
        routes = self._route(columns["labels"])
        routed: dict[str, list[int]] = {key: [] for key in self.callables}
        for i, recipe in enumerate(routes):
            for w in recipe:
                routed[w.key].append(i)

        semaphore = asyncio.Semaphore(self.max_concurrency)
        tasks = [
            asyncio.create_task(self._call(self.callables[key], idx, completions, columns, step, semaphore))
            for key, idx in routed.items()
            if idx
        ]
        outcomes = await _gather_fail_fast(tasks)

        per_function = {key: [math.nan] * n for key in self.callables}
        stats = {key: RewardStats() for key in self.callables}
        seconds: dict[str, float] = {}
        messages: list[str] = []
        for out in outcomes:
            for i, v in zip(out.indices, out.values):
                per_function[out.key][i] = v
            stats[out.key] = RewardStats.of(out.values, out.errors)
            seconds[out.key] = out.seconds
            messages.extend(out.messages)

        total = []
        for i, recipe in enumerate(routes):
            applied = [w.weight * per_function[w.key][i] for w in recipe if not math.isnan(per_function[w.key][i])]
            total.append(math.fsum(applied) if applied else math.nan)
        stats[TOTAL_KEY] = RewardStats.of(total, errors=0)
        stats[TOTAL_KEY].errors = sum(s.errors for s in stats.values())

        return RewardResult(
            total=torch.tensor(total, dtype=torch.float32),
            per_function={k: torch.tensor(v, dtype=torch.float32) for k, v in per_function.items()},
            stats=stats,
            metrics=reward_metrics(stats),
            seconds=seconds,
            error_messages=messages,
        )

    def _route(self, labels: Sequence[str | None]) -> list[tuple[WeightedReward, ...]]:
        routes = []
        for i, label in enumerate(labels):
            recipe = self.recipes.get(label, self.default) if label is not None else self.default
            if not recipe and (label is None or label not in self.recipes):
                raise RewardError(
                    f"RewardSet.score: sample {i} has label {label!r}, which has no entry in reward.recipes, and "
                    f"reward.functions is empty; add reward.recipes.{label or '<label>'} or reward.functions"
                )
            routes.append(recipe)
        return routes

    async def _call(
        self,
        c: RewardCallable,
        idx: list[int],
        completions: Sequence[str],
        columns: dict[str, list[Any]],
        step: int,
        semaphore: asyncio.Semaphore,
    ) -> _Outcome:
        missing = sorted(c.required - set(columns) - {"step"})
        if missing:
            raise RewardError(
                f"reward function {c.key!r} needs argument(s) {missing}, which are neither reward arguments "
                f"({', '.join(REWARD_ARGUMENTS)}) nor dataset columns ({', '.join(sorted(set(columns) - set(REWARD_ARGUMENTS))) or 'none'}); "
                "add the column to the dataset or give the parameter a default"
            )
        kwargs: dict[str, Any] = {
            name: [col[i] for i in idx] for name, col in columns.items() if c.accepts is None or name in c.accepts
        }
        if c.accepts is None or "step" in c.accepts:
            kwargs["step"] = step
        kwargs.update(c.fixed_kwargs)
        sub = [completions[i] for i in idx]
        c.abandoned = [t for t in c.abandoned if t.is_alive()]
        if c.abandoned:
            return self._failed(c, idx, f"was not called on {_describe(idx)}: its call that did not finish within "
                                f"reward.timeout_s={self.timeout_s:g} s is still running", 0.0)
        async with semaphore:
            start = time.perf_counter()
            started: list[threading.Thread] = []
            try:
                raw = await asyncio.wait_for(_invoke(c, sub, kwargs, started), self.timeout_s)
            except asyncio.TimeoutError:
                c.abandoned += started
                return self._failed(
                    c, idx, f"did not finish within reward.timeout_s={self.timeout_s:g} s on {_describe(idx)}; "
                    "make it faster, raise reward.timeout_s, or set reward.on_error=none", time.perf_counter() - start,
                )
            except Exception as exc:  # the function failed: name it and the samples
                text = " ".join(str(exc).split())[:500]
                if isinstance(exc, RewardSampleError) and 0 <= exc.index < len(idx):
                    what = f"failed on sample {idx[exc.index]} (step {step}): {text}"
                elif isinstance(exc, UserError):  # its message already says what to fix
                    what = f"failed on {_describe(idx)} (step {step}): {text}"
                elif isinstance(exc, _Exited):  # a reward must return its scores, not end the process
                    what = (f"{exc.what()} on {_describe(idx)} (step {step}); return the scores (None for 'not "
                            "applicable') instead, or set reward.on_error=none to count failures as not applicable")
                elif type(exc).__name__ == "OutOfMemoryError":  # torch's, e.g. a reward model's batch on a GPU
                    what = (f"ran out of device memory on {_describe(idx)} (step {step}): {text}; lower its batch "
                            "size (the built-in reward_model: kwargs batch_size and max_length)")
                else:
                    what = (f"raised {type(exc).__name__}: {text} (on {_describe(idx)}, step {step}); fix the function "
                            "or set reward.on_error=none to count failures as not applicable")
                return self._failed(c, idx, what, time.perf_counter() - start)
        return self._check(c, idx, sub, raw, time.perf_counter() - start)

    def _failed(self, c: RewardCallable, idx: list[int], what: str, seconds: float) -> _Outcome:
        message = f"reward function {c.key!r} {what}"
        if self.on_error == "raise":
            raise RewardError(message)
        logger.warning("%s", message)
        return _Outcome(c.key, idx, [math.nan] * len(idx), len(idx), [message], seconds)

    def _check(self, c: RewardCallable, idx: list[int], sub: list[str], raw: Any, seconds: float) -> _Outcome:
        """Turn a function's return value into floats (NaN = None), rejecting wrong lengths, NaN, inf and non-numbers."""
        if hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
            raw = raw.tolist()  # tensors and numpy arrays
        if not isinstance(raw, (list, tuple)) or len(raw) != len(idx):
            got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else f"a {type(raw).__name__}"
            return self._failed(
                c, idx, f"returned {got} for {len(idx)} completions ({_describe(idx)}); it must return a list with one "
                "float (or None for 'not applicable') per completion", seconds,
            )
        out = _Outcome(c.key, idx, [], seconds=seconds)
        for j, v in enumerate(raw):
            if v is None:
                out.values.append(math.nan)
                continue
            problem = None
            if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a numpy scalar (np.bool_ too) or 0-d tensor
                v = v.item()  # one rule: a value counts as the Python number it holds, as an array's tolist() gives
            if isinstance(v, (bool, numbers.Real)):
                try:
                    v = float(v)
                except OverflowError:  # e.g. 10**400: an int no float holds
                    size = f" (about 10^{int(math.log10(abs(v)))})" if isinstance(v, int) else ""
                    problem = f"returned a number too large for a float{size} for sample {idx[j]}; return a float or None"
                else:
                    if not math.isfinite(v):
                        problem = (f"returned {v} for sample {idx[j]}; return None for 'not applicable' or fix the "
                                   "function")
            else:
                problem = f"returned a {type(v).__name__} ({str(v)[:40]!r}) for sample {idx[j]}; expected a float or None"
            if problem is None:
                out.values.append(v)
                continue
            message = f"reward function {c.key!r} {problem} (completion {sub[j][:60]!r})"
            if self.on_error == "raise":
                raise RewardError(message)
            logger.warning("%s", message)
            out.values.append(math.nan)
            out.errors += 1
            out.messages.append(message)
        return out


async def _invoke(c: RewardCallable, completions: list[str], kwargs: dict[str, Any],
                  started: list[threading.Thread] | None = None) -> Any:
    """Await an async function directly; run a sync one in its own daemon thread (appended to `started`).

    A daemon thread, not a ThreadPoolExecutor: a sync function that hangs past the timeout cannot be
    killed, and an executor's worker would then block interpreter exit forever.
    """
    if c.is_async:
        try:
            return await c.fn(completions, **kwargs)
        except SystemExit as exc:  # (a KeyboardInterrupt here may be Ctrl-C, which reaches this thread: it goes on)
            raise _Exited(exc) from None
    try:
        result = await call_in_daemon_thread(lambda: c.fn(completions, **kwargs), f"vlrft-reward-{c.key}", started)
    except (SystemExit, KeyboardInterrupt) as exc:  # raised in the function's own thread: its code's, not a signal's
        raise _Exited(exc) from None
    if inspect.isawaitable(result):  # e.g. a sync wrapper returning a coroutine
        result = await result
    return result


class _Exited(Exception):
    """A reward function's SystemExit / KeyboardInterrupt, carried as an ordinary failure: left as they are, asyncio
    would end the whole event loop with them (a traceback, exit code 3 or 130) instead of one line naming the
    function."""

    def __init__(self, exc: BaseException):
        super().__init__(exc)
        self.exc = exc

    def what(self) -> str:
        if isinstance(self.exc, SystemExit):
            return f"called sys.exit({self.exc.code!r})"
        return "raised KeyboardInterrupt" + (f" ({_short_text(self.exc)})" if str(self.exc) else "")


def _short_text(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]


async def _gather_fail_fast(tasks: list[asyncio.Task]) -> list[_Outcome]:
    """Results of all tasks in order; on the first failure, cancel the rest and raise it."""
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in tasks if t in done and t.exception() is not None]
    if failed:
        for t in pending:
            t.cancel()
        raise failed[0].exception()
    return [t.result() for t in tasks]


def _describe(idx: list[int]) -> str:
    """'sample 3', 'samples 0-63' or 'samples [0, 2, 5, ...] (40 samples)'."""
    if len(idx) == 1:
        return f"sample {idx[0]}"
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return f"samples {idx[0]}-{idx[-1]}"
    head = ", ".join(map(str, idx[:8]))
    return f"samples [{head}{', ...' if len(idx) > 8 else ''}] ({len(idx)} samples)"


def _batch_columns(
    completions: Sequence[str],
    prompts: Sequence[str] | None,
    completion_ids: Sequence[Sequence[int]] | None,
    images: Sequence[Sequence[Any]] | None,
    references: Sequence[str | None] | None,
    labels: Sequence[str | None] | None,
    extras: Sequence[dict[str, Any] | None] | None,
) -> dict[str, list[Any]]:
    """Check lengths and types; return every per-completion keyword argument, extra columns included."""
    n = len(completions)
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise RewardError(f"RewardSet.score: completions[{i}] is a {type(c).__name__}; pass decoded text (str)")
    given = {"prompts": prompts, "completion_ids": completion_ids, "images": images, "references": references,
             "labels": labels, "extras": extras}
    for name, value in given.items():
        if value is not None and len(value) != n:
            raise RewardError(f"RewardSet.score: {name} has {len(value)} entries for {n} completions; pass one per completion")
    columns: dict[str, list[Any]] = {
        "prompts": list(prompts) if prompts is not None else [""] * n,
        "completion_ids": list(completion_ids) if completion_ids is not None else [[] for _ in range(n)],
        "images": list(images) if images is not None else [[] for _ in range(n)],
        "references": list(references) if references is not None else [None] * n,
        "labels": list(labels) if labels is not None else [None] * n,
    }
    rows = [row or {} for row in (extras if extras is not None else [None] * n)]
    names: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RewardError(f"RewardSet.score: extras[{i}] is a {type(row).__name__}; pass a dict of extra columns per completion")
        names.update(dict.fromkeys(row))
    for name in names:
        if name in REWARD_ARGUMENTS or name == "completions":
            raise RewardError(f"RewardSet.score: dataset column {name!r} clashes with the reward argument of the same name; rename the column")
        columns[name] = [row.get(name) for row in rows]
    return columns

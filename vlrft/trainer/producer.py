"""Where a step's `Collected` comes from: collected now (synchronous), or ahead of time by rollout servers.

The step is one story either way (`Trainer.train_step`): it asks its producer for step s's
`Collected`, trains on it, syncs the weights and tells the producer the new version.

* `SyncProducer` (every colocated engine, and `rollout.max_staleness=0`): collects step s when
  asked, the engine awake for it: generate, then train.
* `AsyncProducer` (`rollout.engine=vllm_server`, `rollout.max_staleness=k >= 1`): a background
  thread collects step after step while the trainer trains. It prepares step j (counted from the
  producer's first: prompts drawn and processed, requests encoded) at once, but sends it to the
  servers only once the trainer has synced at least j - k times, so every row it hands over was
  sampled by weights at most k syncs older than the trainer's (`staleness`, checked when the step
  takes it). Rewards are scored in that thread too; with several ranks its collectives
  run on a process group of their own, so they never interleave with the trainer's, and its phases
  (`time/generate`, `time/reward`) are timed apart and reported with the step they collected.

Off-policy correction uses the behaviour logprobs the servers returned (truncated importance
sampling, `algorithm.tis_cap`): the trainer's "old" logprobs are recomputed under the weights it
holds, and the TIS weight corrects for the weights that actually sampled.

Resume: a checkpoint after step s records the prompt sampler and engine counters as they were right
after step s was collected. Rollouts collected ahead of that are dropped and regenerated from the
same prompts and seeds after the resume, but by the resumed (newer) weights: "exact resume" in async
mode means the same prompts and sampling seeds, not the same tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from vlrft.errors import UserError
from vlrft.trainer.collect import CollectDeps, Collected, collect
from vlrft.trainer.experience import PhaseTimer


@dataclass(frozen=True)
class Produced:
    """A step's `Collected`, its weight-version stamp, and the state to resume right after it."""

    collected: Collected
    weight_version: int | None  # the oldest version among its rows (None: a colocated engine, always current)
    resume_state: dict[str, Any]  # {"sampler": ..., "engine": ...} as after this step's collection
    waited_s: float = 0.0  # seconds the trainer waited for it
    trainer_version: int | None = None  # the weight version the trainer held when it took the step
    cpu_s: float = 0.0  # CPU seconds the producer's thread spent collecting it (async; taken from the trainer's cores)
    times: dict[str, float] = dataclasses.field(default_factory=dict)  # async: "time/generate", ... of its collection


class SyncProducer:
    """Collect step s when the trainer asks for it (the engine awake meanwhile)."""

    def __init__(self, deps: Callable[[], CollectDeps], awake: Callable[[], ContextManager], engine):
        from vlrft.rollout.base import engine_state

        self._deps = deps
        self._awake = awake
        self._engine = engine
        self._engine_state = lambda: engine_state(engine)

    def next(self, step: int) -> Produced:
        deps = self._deps()
        with self._awake():
            collected = collect(deps, step)
        versions = collected.rollouts.weight_versions
        return Produced(collected, min(versions) if versions else None,
                        {"sampler": deps.sampler.state_dict(), "engine": self._engine_state()},
                        trainer_version=getattr(self._engine, "version", None))

    def weights_synced(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadCollectives:
    """The collectives `collect` uses, on a gloo group of the producer's own (one process: local no-ops)."""

    def __init__(self, strategy):
        self.rank, self.world_size = strategy.rank, strategy.world_size
        self.group = None
        if self.world_size > 1:
            import torch.distributed as dist

            from vlrft.parallel.strategy import collective_timeout

            self.group = dist.new_group(backend="gloo", timeout=collective_timeout())

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone().cpu()
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return out.to(tensor.device)

    def all_gather_object(self, obj) -> list:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class _Stopped(Exception):
    """The producer was closed while waiting for its turn."""


class GatedEngine:
    """The server engine as the producer's `collect` sees it: each generate call is prepared (prompts and images
    encoded) at once, then waits at `gate` for its turn to sample (`AsyncProducer._wait_turn`). So the next step's
    preparation overlaps the trainer's work, and only the sampling waits for the weights. An engine that cannot be
    prepared ahead (multi-turn around the server engine: each turn's requests depend on the turn before) waits for
    its turn before its generate call."""

    def __init__(self, engine, gate: Callable[[], None], timer: PhaseTimer | None):
        self._engine, self._gate, self._timer = engine, gate, timer

    def generate(self, batch, sampling):
        ahead = hasattr(self._engine, "prepare") and hasattr(self._engine, "send")
        prepared = self._engine.prepare(batch, sampling) if ahead else None
        with self._timer.untimed("time/generate") if self._timer is not None else contextlib.nullcontext():
            self._gate()  # waiting for its turn is not generating
        return self._engine.send(prepared) if ahead else self._engine.generate(batch, sampling)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class AsyncProducer:
    """Collect ahead in a background thread, at most `max_staleness` syncs ahead (see the module docstring)."""

    def __init__(self, deps: CollectDeps, max_staleness: int, engine, first_step: int):
        """`deps.strategy`: collectives of the producer's own (`ThreadCollectives`), never the trainer's."""
        self.deps = deps
        self.max_staleness = max_staleness
        self.engine = engine
        self._syncs = 0  # trainer syncs since this producer started
        self._produced = 0  # steps handed over
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._stop = False
        self.waited_s = 0.0  # seconds the producer waited for the trainer's syncs (summed; read per step)
        timer = getattr(deps, "timer", None)  # its phases are stamped on each step it hands over
        self.timer = timer if isinstance(timer, PhaseTimer) else None
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="vlrft-producer", daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        deps = dataclasses.replace(self.deps, engine=GatedEngine(self.engine, self._wait_turn, self.timer))
        while True:
            try:
                cpu = time.thread_time()
                collected = collect(deps, step)
                versions = collected.rollouts.weight_versions or [self.engine.version]
                state = {"sampler": copy.deepcopy(self.deps.sampler.state_dict()),
                         "engine": self.engine.state_dict()}
                self._queue.put(Produced(collected, min(versions), state, cpu_s=time.thread_time() - cpu,
                                         times=self.timer.take() if self.timer is not None else {}))
            except _Stopped:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
                self._queue.put(exc)
                return
            with self._cond:
                self._produced += 1
            step += 1

    def _wait_turn(self) -> None:
        """Before each generate call: wait until the trainer has synced often enough that the weights about to
        sample are at most `max_staleness` syncs older than the ones the step will be trained on."""
        with self._cond:
            start = time.perf_counter()
            while not self._stop and self._syncs < self._produced - self.max_staleness:
                self._cond.wait()
            self.waited_s += time.perf_counter() - start
            if self._stop:
                raise _Stopped

    def next(self, step: int) -> Produced:
        start = time.perf_counter()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        staleness = self.engine.version - item.weight_version
        if staleness > self.max_staleness:  # the wait rule above makes this impossible; a bug if it happens
            raise UserError(f"step {step}: rollouts sampled by weight version {item.weight_version}, "
                            f"{staleness} syncs old (rollout.max_staleness={self.max_staleness})")
        return dataclasses.replace(item, waited_s=time.perf_counter() - start, trainer_version=self.engine.version)

    def weights_synced(self) -> None:
        with self._cond:
            self._syncs += 1
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Stop after the collection in progress (its rollouts are dropped; see the module docstring)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=self.deps.rollout.server_timeout_s + 60)


def make_producer(cfg, deps: Callable[[], CollectDeps], awake: Callable[[], ContextManager], engine,
                  first_step: int):
    """The producer `rollout.max_staleness` asks for."""
    if cfg.rollout.max_staleness == 0:
        return SyncProducer(deps, awake, engine)
    own = deps()
    own = dataclasses.replace(own, strategy=ThreadCollectives(own.strategy), timer=PhaseTimer())
    return AsyncProducer(own, cfg.rollout.max_staleness, engine, first_step)


def staleness_metrics(produced: Produced, producer) -> dict[str, float]:
    """Per step: how old the rows' weights were (mean and max, in syncs), how long each side waited for the other,
    the steps collected ahead, and the CPU time the producer's thread spent collecting this step (on the trainer's
    own cores: what overlapping costs the training side)."""
    out: dict[str, float] = {"async/trainer_wait_s": produced.waited_s}
    if isinstance(producer, AsyncProducer):
        out["async/producer_wait_s"] = producer.waited_s
        out["async/producer_cpu_s"] = produced.cpu_s
        out["async/queue_depth"] = float(producer.queue_depth)
    versions = produced.collected.rollouts.weight_versions
    if versions and produced.trainer_version is not None:
        ages = torch.tensor([produced.trainer_version - v for v in versions], dtype=torch.float64)
        out["async/staleness_mean"] = float(ages.mean())
        out["async/staleness_max"] = float(ages.max())
    return out


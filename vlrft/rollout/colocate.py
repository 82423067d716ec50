"""What the colocated vLLM and SGLang engines share: rank layout, sleep/wake bookkeeping, the generate spine.

An engine lives in the training processes, on their GPUs, and gives its memory back while the
trainer runs (`rollout.sleep_between_steps`). With `rollout.tensor_parallel_size = tp > 1`, ranks
`[g*tp, (g+1)*tp)` form tensor-parallel group g: they hold one engine together and must run it on
the same prompts, so each group pools its ranks' prompts and every rank keeps its own completions.

Nothing here imports vllm or sglang; the engine-specific parts are a `Backend`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch

from vlrft.errors import ConfigError, UserError
from vlrft.rollout.base import Rollouts, SamplingParams
from vlrft.rollout.outputs import EngineError, EngineSample, to_rollouts
from vlrft.rollout.requests import PromptRequest
from vlrft.sampling import request_seed
from vlrft.models.weights import PolicyWeights, policy_module, unsyncable_weights

if TYPE_CHECKING:
    from vlrft.data import PromptBatch
    from vlrft.tokens import TokenSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits among the rollout engines: its tensor-parallel group and that group's leader."""

    rank: int
    world_size: int
    tp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ConfigError(f"config: rollout.tensor_parallel_size={self.tp_size} is not allowed; expected a "
                              f"divisor of the number of processes ({self.world_size}); each group of "
                              "tensor_parallel_size ranks shares one engine")

    @property
    def group(self) -> int:
        return self.rank // self.tp_size

    @property
    def num_groups(self) -> int:
        return self.world_size // self.tp_size

    @property
    def leader(self) -> int:
        return self.group * self.tp_size

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def members(self) -> list[int]:
        return list(range(self.leader, self.leader + self.tp_size))

    def seed(self, base: int) -> int:
        """One seed per engine: ranks of a tensor-parallel group must sample alike, groups must differ."""
        return base + self.group


class GroupComm:
    """Object collectives inside this rank's tensor-parallel group (gloo: prompts and results stay on the CPU)."""

    def __init__(self, layout: RankLayout, timeout: timedelta | None = None):
        """`timeout`: the group's collective timeout (`train.dist_timeout_minutes`; None: torch's gloo default,
        30 min). Members wait in it while the leader's engine starts and generates."""
        self.layout = layout
        self.group = None
        if layout.tp_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(f"config: rollout.tensor_parallel_size={layout.tp_size} needs the processes of a "
                                  "torchrun launch (torch.distributed is not initialised)")
            ranks = [list(range(g * layout.tp_size, (g + 1) * layout.tp_size)) for g in range(layout.num_groups)]
            self.group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout, backend="gloo")

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in member order (just `[obj]` without tensor parallelism)."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.layout.tp_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_to_leader(self, obj: Any) -> list[Any] | None:
        """Every member's `obj` at the leader (in member order); None on the other members."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.layout.tp_size if self.layout.is_leader else None
        dist.gather_object(obj, out, dst=self.layout.leader, group=self.group)
        return out

    def scatter_from_leader(self, objs: list[Any] | None) -> Any:
        """The leader's `objs[k]` arrives at member k."""
        if self.group is None:
            return objs[0]
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.layout.is_leader else None, src=self.layout.leader,
                                 group=self.group)
        return out[0]


def tensor_parallel_group(cfg, rank: int, world_size: int) -> tuple[RankLayout, GroupComm]:
    """This rank's place among the engines' tensor-parallel groups, and its group's object collectives, which take
    the run's collective timeout (`train.dist_timeout_minutes`): members wait in them for their leader's engine."""
    from vlrft.parallel.strategy import collective_timeout

    layout = RankLayout(rank, world_size, cfg.rollout.tensor_parallel_size)
    return layout, GroupComm(layout, collective_timeout(cfg))


class Backend(Protocol):
    """The engine-specific half of a colocated engine (only on ranks that drive an engine)."""

    def run(self, requests: list[PromptRequest], sampling: SamplingParams) -> list[EngineSample]:
        """`sampling.n` samples per request, prompt-major."""

    def release(self) -> None:
        """Free weights and KV cache (their contents are lost)."""

    def resume_weights(self) -> None:
        """Re-allocate weight memory (contents undefined until loaded)."""

    def resume_cache(self) -> None:
        """Re-allocate the KV cache (and whatever else `release` freed)."""

    def load(self, buckets: Iterable[list[tuple[str, Any]]]) -> None:
        """Load buckets of (checkpoint name, tensor) into the engine's weights, reading them one at a time.

        Engines every rank drives (vLLM) get one whole sync in one call, as a generator that gathers each bucket
        when it is asked for it; leader-driven engines (SGLang) get one call per bucket, with every member's
        serialized copy of it (`pack_bucket`)."""

    def weights_loaded(self) -> None:
        """After the last bucket: drop what was computed with the old weights (prefix cache)."""

    def close(self) -> None:
        """Shut the engine down and give its GPU memory back."""


class Memory(enum.Enum):
    AWAKE = "awake"  # weights and KV cache allocated
    WEIGHTS_ONLY = "weights_only"  # weights allocated (being or just updated), KV cache released
    ASLEEP = "asleep"  # both released


@dataclass(frozen=True)
class EngineOptions:
    """How a colocated engine syncs and sleeps (from `rollout.*` and `model.dtype`)."""

    dtype: torch.dtype  # weights are cast to this before they are sent
    device: torch.device | str  # where sent tensors are materialised (the rank's GPU)
    sleep_between_steps: bool = True
    bucket_bytes: int = 512 << 20
    # The strategy's context for reading parameters whole (ZeRO-3), opened per tensor; None: nothing to gather.
    gather: Callable[[list[torch.Tensor]], ContextManager] | None = None
    seed: int = 0  # the engine's sampling seed: equal on the ranks of a tensor-parallel group (RankLayout.seed)


class ColocatedEngine:
    """A `RolloutEngine` around a `Backend`: routing over the tensor-parallel group, sleep/wake, weight sync.

    Released weights are treated as lost, so the engine reloads them from the policy before it
    samples again: `update_weights` does so while asleep (waking only the weights), and `wake` (or
    a `generate` that finds the engine asleep, e.g. evaluation after a step) does it if nobody did.
    """

    def __init__(self, backend: Backend | None, build_requests: Callable[["PromptBatch"], list[PromptRequest]],
                 layout: RankLayout, comm: GroupComm, get_policy: Callable[[], torch.nn.Module], tokenizer,
                 tokens: "TokenSpec", options: EngineOptions, every_rank_drives: bool,
                 pack_bucket: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None):
        self.backend = backend  # None on members of a group whose leader drives the engine alone
        self.build_requests = build_requests
        self.layout = layout
        self.comm = comm
        self._get_policy = get_policy
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.options = options
        # vLLM's external launcher: every member runs the engine on the pooled prompts. SGLang: the
        # leader's engine process owns the whole group, the members hand it their prompts.
        self.every_rank_drives = every_rank_drives
        # Leader-driven engines whose TP workers each load their own GPU's copy (SGLang): every member
        # packs its bucket (serialized handles) and the leader's backend loads the list, one per member.
        self.pack_bucket = pack_bucket
        self.memory = Memory.AWAKE
        self.weights_current = False  # the engine holds the policy's latest weights
        self._weights: PolicyWeights | None = None
        self._generate_calls = 0  # equal on every member: they call generate in lockstep

    @property
    def drives(self) -> bool:
        return self.backend is not None

    # ------------------------------------------------------------------ sampling

    def stop_ids(self, sampling: SamplingParams) -> set[int]:
        return set(self.tokens.eos_ids) | {int(i) for i in sampling.stop_token_ids}

    def sampling_seed(self) -> int:
        """The seed of this `generate` call: a function of the engine seed and the call count only.

        Members of a tensor-parallel group run one engine together (vLLM's external launcher: each
        runs the sampler) and must draw the same random numbers, whatever the trainer did to their
        own generators since the last call (dropout, shuffles, `seed + rank` seeding).
        """
        return (self.options.seed * 1_000_003 + self._generate_calls) % (2**63)

    def state_dict(self) -> dict:
        """What a resumed run needs to sample as the uninterrupted one would: the call count behind the seeds."""
        return {"generate_calls": self._generate_calls}

    def load_state_dict(self, state: dict) -> None:
        self._generate_calls = int(state["generate_calls"])

    def _engine_rng(self):
        """A fork of torch's generators (CPU and this rank's GPU) for the engine; the trainer's streams are kept."""
        device = torch.device(self.options.device)
        gpus = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        return torch.random.fork_rng(devices=gpus)

    def generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        self._ensure_awake()
        self._generate_calls += 1
        with self._engine_rng():
            torch.manual_seed(self.sampling_seed())
            return self._generate(batch, sampling)

    def _generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        try:
            local: tuple[str, Any] = ("ok", self.build_requests(batch))
        except UserError as exc:  # tell the group first, so no member waits for this rank forever
            local = ("error", exc)
        if self.every_rank_drives:
            pooled = self.comm.all_gather(local)
            errors = [item for kind, item in pooled if kind == "error"]
            if errors:
                raise errors[0]
            per_rank = [requests for _, requests in pooled]
            samples = self._run([r for part in per_rank for r in part], sampling)
            mine = _member_slice(samples, per_rank, self.layout.rank - self.layout.leader, sampling.n)
        else:
            kind, mine = self.comm.scatter_from_leader(self._lead(self.comm.gather_to_leader(local), sampling))
            if kind == "error":
                raise mine
        requests = local[1]
        return to_rollouts(mine, sampling.n, self.stop_ids(sampling), sampling.max_new_tokens,
                           lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                           [r.name for r in requests])

    def _lead(self, pooled: list | None, sampling: SamplingParams) -> list | None:
        """On the leader: run the pooled prompts, one ("ok", samples) or ("error", exc) per member."""
        if pooled is None:
            return None
        errors = [item for kind, item in pooled if kind == "error"]
        if errors:
            return [("error", errors[0])] * len(pooled)
        per_rank = [requests for _, requests in pooled]
        try:
            samples = self._run([r for part in per_rank for r in part], sampling)
        except Exception as exc:  # noqa: BLE001 - every member raises it, the leader included
            if self.comm.group is None:
                raise  # nobody waits for us: keep the engine's own traceback
            if not isinstance(exc, (UserError, EngineError)):  # engine exceptions may not pickle
                exc = EngineError(f"the engine failed on the group's prompts: {type(exc).__name__}: {exc}")
            return [("error", exc)] * len(pooled)
        return [("ok", _member_slice(samples, per_rank, k, sampling.n)) for k in range(len(per_rank))]

    def _run(self, requests: list[PromptRequest], sampling: SamplingParams) -> list[EngineSample]:
        """The engine on the pooled requests; none at all (every member's batch was empty) runs nothing."""
        seeded = [dataclasses.replace(r, seed=request_seed(self.options.seed, self._generate_calls, i))
                  for i, r in enumerate(requests)]  # the same on every member: pooled in member order
        return self.backend.run(seeded, sampling) if requests else []

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """Release weights and KV cache while the trainer runs (a no-op with rollout.sleep_between_steps=false)."""
        if not self.options.sleep_between_steps or self.memory is Memory.ASLEEP:
            return
        if self.drives:
            self.backend.release()
        self.memory = Memory.ASLEEP
        self.weights_current = False

    def wake(self) -> None:
        """Take the memory back; reload the policy's weights first if the engine lost them."""
        if self.memory is Memory.AWAKE:
            return
        if self.memory is Memory.ASLEEP:
            self._resume_weights()
        if not self.weights_current:
            self._load_policy(self._get_policy())
        if self.drives:
            free_cached_gpu_memory()
            self.backend.resume_cache()
        self.memory = Memory.AWAKE

    def _ensure_awake(self) -> None:
        if self.memory is not Memory.AWAKE:
            self.wake()

    def _resume_weights(self) -> None:
        if self.drives:
            free_cached_gpu_memory()
            self.backend.resume_weights()
        self.memory = Memory.WEIGHTS_ONLY

    # ------------------------------------------------------------------ weights

    def update_weights(self, model: torch.nn.Module) -> None:
        """Load the policy's current weights (LoRA merged, engine dtype), a bucket at a time.

        Asleep, only the weights wake up; the KV cache stays released until `wake`.
        """
        if self.memory is Memory.ASLEEP:
            self._resume_weights()
        self._load_policy(model)

    def close(self) -> None:
        """Shut the engine down (end of training, tests); the object is unusable afterwards."""
        if self.drives:
            self.backend.close()
            self.backend = None

    def _policy_weights(self, model: torch.nn.Module) -> PolicyWeights:
        if self._weights is None or self._weights.model is not policy_module(model):
            hf_model = policy_module(model)
            unsyncable = unsyncable_weights(hf_model)
            if unsyncable:  # the engine was just built: said at start-up, not after a step's work
                raise UserError(f"{type(hf_model).__name__}: {len(unsyncable)} weight(s) are laid out in memory "
                                f"otherwise than in the published checkpoint (e.g. '{unsyncable[0]}', fused MoE "
                                "experts); vLLM/SGLang weight sync sends weights as they are in memory, which their "
                                "loaders would read wrongly; use rollout.engine=hf for this model")
            self._weights = PolicyWeights(model, self.options.dtype, self.options.gather)
        return self._weights

    def _load_policy(self, model: torch.nn.Module) -> None:
        if self.pack_bucket is not None:  # every member walks the buckets and ends with weights_loaded
            self._load_packed(model)
            self.weights_current = True
            return
        buckets = self._policy_weights(model).buckets(self.options.bucket_bytes, self.options.device)
        if self.drives:
            self.backend.load(buckets)
            self.backend.weights_loaded()
        elif self._policy_weights(model).sharded:  # gathering shards is collective: every rank walks the buckets
            for bucket in buckets:
                del bucket  # not held while the next bucket is gathered
        self.weights_current = True

    def _load_packed(self, model: torch.nn.Module) -> None:
        """Every member packs each bucket from its own GPU; the leader loads them together, then all go on.

        The leader's outcome reaches every member after each bucket, so a member keeps its tensors
        alive until the engine has read them and a failure raises everywhere (nobody is left waiting).
        """
        for bucket in self._policy_weights(model).buckets(self.options.bucket_bytes, self.options.device):
            packed = self.comm.gather_to_leader(self.pack_bucket(bucket))
            self._leader_step(lambda packed=packed: self.backend.load([packed]))  # run by the leader only
            del bucket, packed  # not held while the next bucket is gathered
        self._leader_step(self.backend.weights_loaded if self.drives else lambda: None)

    def _leader_step(self, step: Callable[[], None]) -> None:
        """Run `step` on the leader; its success or its error arrives at every member."""
        if self.comm.group is None:
            step()  # nobody waits for us: keep the engine's own traceback
            return
        outcome: tuple[str, Exception | None] | None = None
        if self.drives:
            try:
                step()
                outcome = ("ok", None)
            except Exception as exc:  # noqa: BLE001 - every member raises it, the leader included
                if not isinstance(exc, (UserError, EngineError)):  # engine exceptions may not pickle
                    exc = EngineError(f"the engine failed to load weights: {type(exc).__name__}: {exc}")
                outcome = ("error", exc)
        kind, error = self.comm.scatter_from_leader([outcome] * self.layout.tp_size if self.drives else None)
        if kind == "error":
            raise error


def free_cached_gpu_memory() -> None:
    """Give the trainer's cached-but-free CUDA blocks back before the engine re-maps its memory.

    PyTorch's caching allocator keeps freed activations reserved; an engine waking up (vLLM's
    `wake_up` maps its pool without emptying that cache first) would otherwise run out of memory.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _member_slice(samples: list[EngineSample], per_rank: Sequence[list], member: int, n: int) -> list[EngineSample]:
    """The samples of member `member`'s prompts out of the pooled, prompt-major samples."""
    start = sum(len(part) for part in per_rank[:member]) * n
    return samples[start:start + len(per_rank[member]) * n]

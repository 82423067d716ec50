"""What a memory plan is: the hardware and strategy it is made for, and its components (bytes per GPU and per
node, by phase), with the totals and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30
CUDA_RESERVE = 2 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed")
# "load": before the first step (host memory: the checkpoint read; on the GPU only the reserve then)
PHASES = ("load", "rollout", "train")


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory: int = 80 * GiB  # bytes per GPU

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class StrategyChoice:
    """How the trained models are laid out over ranks (`train.strategy` and its options)."""

    name: str = "ddp"
    zero_stage: int = 3  # deepspeed only: 2 or 3
    offload_optimizer: bool = False  # optimizer state (and for FSDP2 parameters and gradients) on the CPU
    offload_params: bool = False  # ZeRO-3 / FSDP2 parameters on the CPU
    mixed_precision: bool = True  # bf16 compute on GPUs (False: float32 everywhere, as on CPU)

    def describe(self) -> str:
        if self.name == "deepspeed":
            extra = [f"ZeRO-{self.zero_stage}"] + (["optimizer offload"] if self.offload_optimizer else []) + \
                (["parameter offload"] if self.offload_params else [])
            return "deepspeed (" + ", ".join(extra) + ")"
        if self.name == "fsdp2" and (self.offload_optimizer or self.offload_params):
            return "fsdp2 (CPU offload)"
        return self.name


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    phases: tuple[str, ...]  # "load", "rollout", "train"
    note: str


@dataclass
class MemoryPlan:
    model: str
    parameters: int  # policy parameter count
    trainable: int
    strategy: str
    hardware: Hardware
    gradient_checkpointing: bool
    components: list[Component]
    engine_kv_bytes: int | None = None  # vLLM/SGLang: KV cache left after the engine's weights
    engine_kv_needed: int | None = None  # one sequence of max_model_len tokens
    suggestions: list[str] = field(default_factory=list)
    host: list[Component] = field(default_factory=list)  # host memory of one node (the first, where rank 0 is)
    not_counted: list[str] = field(default_factory=list)  # what the plan could not size (e.g. a reward model's config)

    def host_total(self, phase: str) -> int:
        return sum(c.bytes for c in self.host if phase in c.phases)

    def phase_total(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if phase in c.phases)

    @property
    def total(self) -> int:
        return max(self.phase_total(phase) for phase in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(("rollout", "train", "load"), key=self.phase_total)  # ties: the step's phases first

    @property
    def capacity(self) -> int:
        return self.hardware.gpu_memory

    @property
    def engine_ok(self) -> bool:
        return self.engine_kv_bytes is None or self.engine_kv_bytes >= (self.engine_kv_needed or 0)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.engine_ok

    def component(self, name: str) -> int:
        return sum(c.bytes for c in self.components if c.name == name)

    def to_json(self) -> dict:
        return {
            "model": self.model, "parameters": self.parameters, "trainable_parameters": self.trainable,
            "strategy": self.strategy, "gpus_per_node": self.hardware.gpus_per_node, "nodes": self.hardware.nodes,
            "world_size": self.hardware.world_size, "gradient_checkpointing": self.gradient_checkpointing,
            "per_gpu_bytes": {c.name: c.bytes for c in self.components},
            "phases": {phase: {"components": [c.name for c in self.components if phase in c.phases],
                               "total": self.phase_total(phase)} for phase in PHASES},
            "engine_kv_cache_bytes": self.engine_kv_bytes, "engine_kv_needed_bytes": self.engine_kv_needed,
            "total": self.total, "peak_phase": self.peak_phase, "capacity": self.capacity, "fits": self.fits,
            "suggestions": self.suggestions,
            "per_node_host_bytes": {c.name: c.bytes for c in self.host},
            "host_phases": {phase: self.host_total(phase) for phase in PHASES},
            "not_counted": self.not_counted,
        }


def in_gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"

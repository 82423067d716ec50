"""Per-GPU memory of a run, by arithmetic: does a config fit on the GPUs it names, and what to change if not.

Pure functions on dataclasses (no torch, no model): `plan_memory(cfg, shape, hardware, strategy)`
returns a `MemoryPlan` whose components are the bytes one GPU holds for each part of the run.
A step has two phases and the plan takes the larger:

- rollout: the engine is awake (vLLM/SGLang take `gpu_memory_utilization` of the GPU; the hf engine
  a KV cache for the rank's rollout batch) beside what the trainer keeps resident between steps
  (parameters, optimizer state, reference, critic; gradients are freed after each optimizer step);
- train: the engine sleeps; parameters, gradients, optimizer state, activations of one
  micro-batch and the LM-head chunk are alive together.

Byte counts follow what vlrft does: the trainer holds the policy in float32 and computes in
bfloat16 under autocast (DDP: 4 B parameters + 4 B gradients + 4 B DDP gradient buckets + 8 B
AdamW moments per parameter, replicated); FSDP2 shards the float32 parameters, gradients and
moments over all ranks and gathers bfloat16 copies one decoder layer at a time; DeepSpeed ZeRO
with bf16 keeps bfloat16 parameters and gradients plus a float32 master copy and moments
(ZeRO-2 shards gradients and optimizer state, ZeRO-3 also the parameters). Activation figures
are estimates per token and layer for a bf16 Llama-style block with SDPA attention (no S x S
scores), the logits chunk that `vlrft.models.logprobs` materialises, and every prompt distinct
and padded to data.max_prompt_length (the worst case). A fixed reserve covers the CUDA context,
NCCL and allocator slack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from vlrft.plan.architecture import ModelShape
from vlrft.plan.reward_models import RewardModelShape
from vlrft.sampling import PREFILL_TOKENS, hf_decoder, shares_prompt  # the hf decoder's, not copies

GiB = 1 << 30
CUDA_RESERVE = 2 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
LOGITS_CHUNK_TOKENS = 1024  # ActorVL's default chunk_tokens
LOGITS_CHUNK_ELEMENTS = 1 << 24  # vlrft.models.logprobs: logits per chunk, so large vocabularies get fewer tokens
LOGITS_BYTES_PER_ELEMENT = 28  # bf16 logits, fp32 copies (scaled, probs, probs*logits), backward grads
DEEPSPEED_BUCKET_ELEMENTS = 5 * 10 ** 8  # DeepSpeed's default reduce_bucket_size / allgather_bucket_size
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


# ------------------------------------------------------------------ the arithmetic


def _layer_activation_bytes(hidden: int, q_dim: int, kv_dim: int, intermediate: int, compute_bytes: int) -> int:
    """Bytes kept per token by one transformer block for backward (fp32 residual stream, `compute_bytes` matmuls).

    Two RMS/LayerNorms in float32 (input, float copy, normalised) plus their low-precision output;
    q/k/v before and after rotary embedding, the attention output; a gated MLP's four intermediates.
    """
    norms = 2 * (12 * hidden + compute_bytes * hidden)
    attention = compute_bytes * (2 * (q_dim + 2 * kv_dim) + 2 * q_dim)
    mlp = 4 * compute_bytes * intermediate
    return norms + attention + mlp


def _tower_activations(tokens: int, layers: int, per_token_layer: int, hidden: int, checkpointing: bool) -> int:
    """A stack of blocks: all activations kept, or (checkpointing) every block's input plus one block replayed."""
    if checkpointing:
        return tokens * (4 * hidden * layers + 2 * per_token_layer)
    return tokens * layers * per_token_layer


def _per_token_layer_bytes(shape: ModelShape, compute_bytes: int) -> tuple[int, int]:
    """(a text layer's, a vision block's) activation bytes per token (`_layer_activation_bytes`)."""
    t, v = shape.text, shape.vision
    return (_layer_activation_bytes(t.hidden_size, t.num_heads * t.head_dim, t.kv_dim, t.intermediate_size,
                                    compute_bytes),
            _layer_activation_bytes(v.hidden_size, v.hidden_size, v.hidden_size, v.intermediate_size, compute_bytes))


def activation_bytes(shape: ModelShape, tokens: int, patches: int, checkpointing: bool, compute_bytes: int) -> int:
    """Activations of one micro-batch's forward + backward through the language model (`tokens` positions) and the
    vision tower (`patches` patches)."""
    t, v = shape.text, shape.vision
    text_layer, vision_layer = _per_token_layer_bytes(shape, compute_bytes)
    text = _tower_activations(tokens, t.num_layers, text_layer, t.hidden_size, checkpointing)
    text += tokens * t.hidden_size * (12 + 4)  # final norm and the completion states fed to the LM head
    vision = _tower_activations(patches, v.depth, vision_layer, v.hidden_size, checkpointing)
    return text + vision


def completion_pass_bytes(shape: ModelShape, rows: int, prompt_len: int, completion_tokens: int,
                          completion_len: int, checkpointing: bool, compute_bytes: int) -> int:
    """What the shared-prompt forward's completion pass adds per layer call: the rows' copies of their prompt's keys
    (float32 under autocast) and values; transformers' SDPA path repeating a GQA model's keys and values to every
    query head (it does under an attention mask, which this pass always has); and the [rows, C, P + C] mask, bool
    once and in the compute dtype per layer call. One layer's under gradient checkpointing, every layer's kept for
    the backward without it (measured: `tests/test_plan.py`)."""
    t = shape.text
    repeated = t.num_heads * t.head_dim if t.num_heads > t.num_kv_heads else 0
    layers = 1 if checkpointing else t.num_layers
    copies = rows * prompt_len * (t.kv_dim + repeated) * (4 + compute_bytes) * layers
    mask = completion_tokens * (prompt_len + completion_len) * (1 + compute_bytes * layers)
    return copies + mask


def prompt_kv_bytes(shape: ModelShape, prompt_tokens: int, checkpointing: bool, key_bytes: int, value_bytes: int
                    ) -> int:
    """The shared-prompt forward's record of every layer's prompt keys and values, and their gradients.

    The completion pass reads every layer's prompt keys/values, and their gradients reach the prompt pass only after
    the completion pass's whole backward: both are alive for all layers at once. Under checkpointing that comes on
    top of the layer inputs; without it the records are among a layer's activations, and only the gradients count.
    Keys follow the residual stream's dtype (float32 under autocast over float32 weights), values the compute dtype.
    """
    per_token = shape.text.num_layers * shape.text.kv_dim * (key_bytes + value_bytes)
    return prompt_tokens * per_token * (2 if checkpointing else 1)


def head_backward_bytes(shape: ModelShape, trained: bool, float32_weights: bool) -> int:
    """What the chunked LM head's backward (`vlrft.models.logprobs`) allocates beside the model's own gradients: the
    head's float32 gradient accumulated over the chunks (when the head trains) and, for bf16 products over float32
    weights, the head cast once."""
    return shape.text.vocab_size * shape.text.hidden_size * ((4 if trained else 0) + (2 if float32_weights else 0))


def chunk_tokens(shape: ModelShape) -> int:
    """Tokens per LM-head chunk, as vlrft.models.logprobs.chunk_tokens_for picks them."""
    return max(1, min(LOGITS_CHUNK_TOKENS, LOGITS_CHUNK_ELEMENTS // max(shape.text.vocab_size, 1)))


def logits_bytes(shape: ModelShape, micro_batch: int, completion_len: int) -> int:
    """The LM-head chunk alive at once: its completion tokens (capped by the element budget) times the vocabulary."""
    tokens = min(chunk_tokens(shape), micro_batch * completion_len)
    return tokens * shape.text.vocab_size * LOGITS_BYTES_PER_ELEMENT


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.text.num_layers * shape.text.kv_dim * dtype_bytes


GENERATE_SCORE_COPIES = 4  # float32 [rows, vocabulary] tensors alive in a `generate` step (see engine_components)


def generate_scores_bytes(shape: ModelShape, rows: int) -> int:
    """The score tensors of one `generate` sampling step over `rows` rows."""
    return GENERATE_SCORE_COPIES * rows * shape.text.vocab_size * 4


@dataclass(frozen=True)
class _ModelState:
    """Resident bytes of one trained model (policy or critic) under a strategy."""

    parameters: int
    gradients: int
    optimizer: int
    buffers: int  # DDP gradient buckets / DeepSpeed communication buckets (resident)
    gathered: int  # transient: bf16 layers gathered for compute (sharded strategies), train phase
    notes: dict
    resident_gradients: bool = False  # allocated once and never freed (ZeRO-3), not only while training
    resident_buffers: bool = True  # False: allocated for each backward and freed after it (ZeRO-2's bucket)


def _model_state(params: int, trainable: int, shape: ModelShape, s: StrategyChoice, world: int) -> _ModelState:
    hi = 2 if s.mixed_precision else 4  # low-precision compute bytes
    if s.name in ("single", "ddp"):
        buckets = 4 * trainable if s.name == "ddp" and world > 1 else 0
        return _ModelState(4 * params, 4 * trainable, 8 * trainable, buckets, 0, {
            "parameters": "float32, replicated on every GPU", "gradients": "float32, replicated",
            "optimizer": "AdamW moments (2 x float32), replicated",
            "buffers": "DDP gradient buckets (a float32 copy of the gradients)"})
    if s.name == "fsdp2":
        offload = s.offload_optimizer or s.offload_params  # FSDP2's CPUOffloadPolicy moves all three
        shard = 0 if offload else 1
        # the root unit (embeddings, LM head) stays gathered through forward and backward, with its unsharded
        # gradient; decoder layers are gathered one at a time (current + prefetched) with one layer's gradient
        gathered = (hi + 4) * shape.blocks()["root"] + (2 * hi + 4) * shape.largest_layer()
        return _ModelState(shard * 4 * params // world, shard * 4 * trainable // world,
                           shard * 8 * trainable // world, 0, gathered, {
            "parameters": f"float32 shards (1/{world})" + (" on the CPU" if offload else ""),
            "gradients": f"float32 shards (1/{world})" + (" on the CPU" if offload else ""),
            "optimizer": f"AdamW moments, sharded (1/{world})" + (" on the CPU" if offload else ""),
            "gathered": "gathered for compute: the root (embeddings, LM head) and two decoder layers, with gradients"})
    if s.name == "deepspeed":
        # vlrft runs DeepSpeed with float32 weights and gradients (its bf16 mode off; on GPUs the forward runs under
        # bf16 autocast, as with DDP). ZeRO's optimizer keeps its own float32 partition of the weights, also when
        # they are float32 already (measured with bench/bench_memory.py: 726 MiB of optimizer state per rank for
        # 126.8M parameters on 2 ranks)
        master = 4
        opt = 0 if s.offload_optimizer else (8 + master) * trainable // world
        param_bytes = 4 * params if s.zero_stage < 3 else (0 if s.offload_params else 4 * params // world)
        # With offload_optimizer the float32 gradient partitions live in host memory beside the master weights
        # (ZeRO-2 and ZeRO-3 alike: `host_memory`); the GPU keeps only the reduce bucket they pass through.
        grads = 0 if s.offload_optimizer else 4 * trainable // world
        zero3 = s.zero_stage >= 3
        # ZeRO-3 allocates one float32 reduce bucket of 5e8 elements and its flat gradient partition when the engine
        # is built and never frees either (stage3.py: ipg bucket buffers, grad_partitions_flat_buffer). ZeRO-2
        # allocates its reduce bucket (one: overlap_comm is off by default below stage 3) at each backward and
        # releases it after (stage_1_and_2.py: setup_buckets, _release_ipg_buffers); its all-gather of the updated
        # partitions writes into the flat weights in place.
        buckets = DEEPSPEED_BUCKET_ELEMENTS * 4
        gathered = 4 * shape.blocks()["root"] + 2 * 4 * shape.largest_layer() if zero3 else 0
        place = "replicated" if not zero3 else f"sharded (1/{world})" + (" on the CPU" if s.offload_params else "")
        return _ModelState(param_bytes, grads, opt, buckets, gathered, {
            "parameters": f"float32, {place}",
            "gradients": (f"float32, sharded (1/{world})" + ("; ZeRO-3 allocates them once, so also while the engine "
                                                             "samples" if zero3 else "")
                          if not s.offload_optimizer else "on the CPU with the optimizer (offload_optimizer)"),
            "optimizer": ("on the CPU" if s.offload_optimizer else
                          f"AdamW moments{' + float32 master' if master else ''}, sharded (1/{world})"),
            "buffers": ("ZeRO-3 reduce bucket (5e8 float32 elements), allocated once" if zero3 else
                        "ZeRO-2 reduce bucket (5e8 float32 elements) while gradients are reduced"),
            "gathered": "ZeRO-3: parameters gathered for the layers being computed"},
            resident_gradients=zero3, resident_buffers=zero3)
    raise ValueError(f"unknown strategy {s.name!r}; expected one of {', '.join(STRATEGIES)}")


def hf_engine_weights(params: int, s: StrategyChoice) -> tuple[int, str]:
    """(bytes, note) the hf engine holds beside the trainer's state while it samples: the policy's whole weights
    where they are sharded (gathered for every `generate` call), and their copy in the compute dtype where the
    weights are float32 under bf16 autocast (the lean decoder's concatenated casts, or autocast's cast cache)."""
    cast = 2 * params if s.mixed_precision else 0
    if s.name == "fsdp2":  # every unit gathered, in FSDP2's parameter dtype: bf16 with mixed precision, no copy
        gathered = (2 if s.mixed_precision else 4) * params
        return gathered, "hf engine: the policy gathered whole for generation (FSDP2 parameter dtype)"
    if s.name == "deepspeed" and s.zero_stage >= 3:
        return 4 * params + cast, ("hf engine: the policy gathered whole for generation (float32)"
                                   + (" and cast to bf16 under autocast" if cast else ""))
    return cast, "hf engine: bf16 copy of the float32 weights, made under autocast for each generate call"


def _offloaded_during_rollout(cfg, strategy: StrategyChoice) -> bool:
    """FSDP2 moves its GPU-resident state to host memory while vLLM/SGLang sample (train.fsdp.offload_during_rollout);
    with train.fsdp.cpu_offload it lives there already."""
    return (strategy.name == "fsdp2" and not (strategy.offload_optimizer or strategy.offload_params)
            and cfg.train.fsdp.offloads_during_rollout(cfg.rollout.engine, on_gpu=True))


def host_memory(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice, params: int,
                trainable: int) -> list[Component]:
    """Host memory of one node (the first: rank 0's): the policy's checkpoint read at start-up and the state
    offloaded to the CPU. Not counted: the reference and critic loads (they come after the policy's copy is freed),
    the processes' own memory (CUDA context, libraries: a few GiB per rank) and the page cache."""
    ranks = min(hardware.gpus_per_node, hardware.world_size)
    share = ranks / hardware.world_size  # the part of a sharded state that one node's ranks hold
    stored = "bfloat16" if shape.checkpoint_bytes == 2 else "float32"
    lora = cfg.model.lora.rank > 0
    comps = []
    if strategy.name == "fsdp2":  # with LoRA in float32: rank 0's adapters are made on that model, then broadcast
        comps.append(Component("checkpoint_read", (4 if lora else shape.checkpoint_bytes) * params, ("load",),
                               f"rank 0 reads the checkpoint in {'float32' if lora else f'its own dtype ({stored})'}; "
                               "the other ranks receive their shards"))
    elif strategy.name == "deepspeed" and strategy.zero_stage >= 3:  # with LoRA too: the adapters come after
        # built inside zero.Init; rank 0's checkpoint tensors are copied into every rank's partition (measured with
        # bench/bench_loading.py: rank 0 holds about the checkpoint more than rank 1 after loading; docs/deepspeed.md)
        comps.append(Component("checkpoint_read", shape.checkpoint_bytes * params, ("load",),
                               f"ZeRO-3: rank 0 reads the checkpoint ({stored}); every rank keeps its partition"))
    else:
        comps.append(Component("checkpoint_read", 4 * params * ranks, ("load",),
                               f"each of the node's {ranks} rank(s) loads the whole policy in float32 before moving "
                               "it to its GPU"))
    if strategy.name == "fsdp2" and (strategy.offload_optimizer or strategy.offload_params):
        comps += [  # the shards are made on the host at load, the moments at the first step, gradients per step
            Component("offloaded_shards", int(4 * params * share), ("load", "rollout", "train"),
                      "train.fsdp.cpu_offload: the node's float32 shards"),
            Component("offloaded_moments", int(8 * trainable * share), ("rollout", "train"),
                      "train.fsdp.cpu_offload: the node's AdamW moments"),
            Component("offloaded_gradients", int(4 * trainable * share), ("train",),
                      "train.fsdp.cpu_offload: the node's float32 gradient shards")]
    elif _offloaded_during_rollout(cfg, strategy):
        others = (2 if strategy.mixed_precision else 4) * params if cfg.algorithm.kl_coef > 0 else 0  # reference
        if cfg.algorithm.advantage == "gae":
            others += 12 * params  # the critic's shards and moments
        comps.append(Component("offloaded_during_rollout", int((4 * params + 8 * trainable + others) * share),
                               ("rollout",), "train.fsdp.offload_during_rollout: the node's shards and AdamW moments "
                               "(and reference / critic shards) while the engine samples"))
    if strategy.name == "deepspeed":
        offloaded = (16 * trainable if strategy.offload_optimizer else 0) + \
            (4 * params if strategy.offload_params and strategy.zero_stage >= 3 else 0)
        if offloaded:  # DeepSpeed allocates them when the engine is built
            comps.append(Component("offloaded_state", int(offloaded * share), ("load", "rollout", "train"),
                                   "ZeRO offload: the node's partitions of the float32 master weights, gradients "
                                   "and AdamW moments" + (" and of the parameters" if strategy.offload_params else "")))
    return comps


def reward_model_components(reward_models: Sequence[RewardModelShape], ranks_per_node: int
                            ) -> tuple[list[Component], list[Component]]:
    """(per-GPU, first node's host) components of the reward models: an offloaded one is on the GPU only while it
    scores (the rollout phase, beside the awake engine) and in pinned host memory on every rank of the node; a
    resident one holds its weights in both phases."""
    gpu, host = [], []
    for rm in reward_models:
        where = f"reward model {rm.key!r} ({rm.parameters / 1e9:.2f} B parameters, {rm.path})"
        if rm.offload:
            gpu.append(Component(f"reward_model:{rm.key}", rm.weight_bytes + rm.activation_bytes, ("rollout",),
                                 f"{where}: copied to the GPU for scoring, with one batch's activations"))
            host.append(Component(f"reward_model:{rm.key}", rm.weight_bytes * ranks_per_node, PHASES,
                                  f"{where}: pinned weights of each of the node's {ranks_per_node} rank(s) (offload)"))
        else:
            gpu.append(Component(f"reward_model:{rm.key}", rm.weight_bytes, ("rollout", "train"),
                                 f"{where}: resident on the GPU (offload: false)"))
            gpu.append(Component(f"reward_model_activations:{rm.key}", rm.activation_bytes, ("rollout",),
                                 f"{where}: one batch of {rm.batch_size} x {rm.max_length} tokens"))
    return gpu, host


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def prompt_patches(cfg, shape: ModelShape, images_per_prompt: int, videos_per_prompt: int) -> int:
    """Vision patches of one prompt at most: each image at data.max_pixels, each video as data.video_max_frames
    frames at data.max_pixels (a temporal patch spans `temporal_patch_size` frames), all of it within
    data.max_prompt_length tokens of merge^2 patches each (a longer prompt is refused)."""
    v, d = shape.vision, cfg.data
    per_frame = d.max_pixels // (v.patch_size ** 2)
    video = -(-d.video_max_frames // max(1, v.temporal_patch_size)) * per_frame
    return min(images_per_prompt * per_frame + videos_per_prompt * video,
               d.max_prompt_length * v.spatial_merge_size ** 2)


def plan_memory(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice,
                images_per_prompt: int = 1, suggest: bool = True,
                reward_models: Sequence[RewardModelShape] = (), videos_per_prompt: int = 0) -> MemoryPlan:
    """Per-GPU bytes of `cfg` (a `vlrft.config.Config`) for `shape` on `hardware` under `strategy`, with the
    GPU reward models `reward_models` (`vlrft.plan.reward_models.reward_model_shapes`)."""
    world = hardware.world_size
    m, r, a, d = cfg.model, cfg.rollout, cfg.algorithm, cfg.data
    params = shape.num_parameters
    if m.lora.rank > 0:
        trainable = shape.lora_parameters(m.lora.rank, m.lora.target_modules, exclude_vision=m.freeze_vision_tower)
    else:
        trainable = params - (shape.tower_count() if m.freeze_vision_tower else 0)
    hi = 2 if strategy.mixed_precision else 4
    policy = _model_state(params, trainable, shape, strategy, world)
    both, train = ("rollout", "train"), ("train",)
    # train.fsdp.offload_during_rollout: the shards, moments, reference and critic are in host memory while the
    # engine samples (`host_memory` counts them there)
    resident = train if _offloaded_during_rollout(cfg, strategy) else both
    comps = [
        Component("parameters", policy.parameters, resident, policy.notes["parameters"]),
        Component("gradients", policy.gradients, resident if policy.resident_gradients else train,
                  policy.notes["gradients"]),
        Component("optimizer", policy.optimizer, resident, policy.notes["optimizer"]),
    ]
    if policy.buffers:
        comps.append(Component("buffers", policy.buffers, resident if policy.resident_buffers else train,
                               policy.notes["buffers"]))
    if policy.gathered:
        comps.append(Component("gathered_layers", policy.gathered, train, policy.notes["gathered"]))
    if a.kl_coef > 0:
        # DeepSpeed builds the reference as an inference ZeRO-3 engine whatever the policy's stage
        # (`vlrft.parallel.deepspeed`: `ds_config(trainable=False)`)
        sharded = strategy.name in ("fsdp2", "deepspeed")
        ref = hi * params // (world if sharded else 1)
        comps.append(Component("reference", ref, resident, f"{m.dtype if hi == 2 else 'float32'} reference policy, "
                               + (f"sharded (1/{world})" if sharded else "replicated")))
    if a.advantage == "gae":
        critic_params = params + shape.text.hidden_size + 1  # the backbone with a scalar value head
        critic = _model_state(critic_params, critic_params, shape, strategy, world)
        # a bucket made per backward (ZeRO-2) is the policy's or the critic's, never both at once: counted once
        critic_buffers = critic.buffers if critic.resident_buffers else 0
        comps.append(Component("critic", critic.parameters + critic.optimizer + critic_buffers, resident,
                               "value model: parameters + optimizer state (as the policy)"))
        comps.append(Component("critic_gradients", critic.gradients, resident if critic.resident_gradients else train,
                               "value model gradients"))
    seq_len = d.max_prompt_length + r.tokens_after_prompt  # a trajectory with tools
    patches = prompt_patches(cfg, shape, images_per_prompt, videos_per_prompt)
    media = f"{images_per_prompt} image(s)" + (f" and {videos_per_prompt} video(s)" if videos_per_prompt else "")
    batch = micro_batch_size(cfg, shape, world, patches, seq_len)
    tokens, vision, rows, what = batch.tokens, batch.vision_patches, batch.rows, batch.what
    completion_tokens, prompt_tokens = batch.completion_tokens, batch.prompt_tokens
    copies = completion_pass_bytes(shape, rows, d.max_prompt_length, completion_tokens, r.tokens_after_prompt,
                                   m.gradient_checkpointing, hi)
    acts = activation_bytes(shape, tokens, vision, m.gradient_checkpointing, hi) + copies
    comps.append(Component("activations", acts, train,
                           f"{what}; {media} per prompt: {vision} vision patches; gradient checkpointing "
                           f"{'on' if m.gradient_checkpointing else 'off'}"))
    float32_weights = strategy.mixed_precision and strategy.name != "fsdp2"  # bf16 matmuls over float32 weights
    comps.append(Component("prompt_kv", prompt_kv_bytes(shape, prompt_tokens, m.gradient_checkpointing,
                                                        4 if float32_weights else hi, hi), train,
                           f"the micro-batch's prompt tokens' keys and values, every layer's"
                           f"{', and their gradients' if m.gradient_checkpointing else ' gradients'}"))
    head_bytes = head_backward_bytes(shape, trained=m.lora.rank == 0, float32_weights=float32_weights)
    if head_bytes:  # under FSDP2 too: beside the gathered root's weight and gradient (gathered_layers)
        comps.append(Component("head_backward", head_bytes, train,
                               "the LM head's backward over the logits chunks: its float32 gradient, accumulated "
                               "before it reaches .grad" + (", and the head in bf16" if float32_weights else "")))
    if float32_weights and not m.gradient_checkpointing:
        # float32 weights under bf16 autocast: each matmul's bf16 copy of its weight is kept for the backward (ZeRO-3's
        # gathered layers' too); under checkpointing one layer's at a time. FSDP2 gathers bf16 weights: no copies.
        # not the embeddings (a lookup) nor the LM head (the chunked head keeps its float32 weight for the backward)
        head_and_embeddings = shape.text.vocab_size * shape.text.hidden_size * (1 if shape.tie_word_embeddings else 2)
        cast = params - head_and_embeddings - (shape.tower_count() if m.freeze_vision_tower else 0)
        comps.append(Component("weight_casts", 2 * cast, train,
                               "bf16 copies of the float32 weights, made by autocast and kept for the backward "
                               "(model.gradient_checkpointing: true keeps one layer's at a time)"))
    comps.append(Component("logits", logits_bytes(shape, 1, completion_tokens), train,
                           f"LM-head chunk of {chunk_tokens(shape)} tokens x {shape.text.vocab_size} vocabulary"))
    engine, kv_avail, kv_needed = engine_components(cfg, shape, hardware, strategy, hi, patches, seq_len)
    comps += engine
    rm_gpu, rm_host = reward_model_components(reward_models, min(hardware.gpus_per_node, world))
    comps += rm_gpu
    comps.append(Component("cuda_reserve", CUDA_RESERVE, ("load", *both), "CUDA context, NCCL buffers, allocator slack"))
    plan = MemoryPlan(model=shape.source, parameters=params, trainable=trainable, strategy=strategy.describe(),
                      hardware=hardware, gradient_checkpointing=m.gradient_checkpointing, components=comps,
                      engine_kv_bytes=kv_avail, engine_kv_needed=kv_needed,
                      host=host_memory(cfg, shape, hardware, strategy, params, trainable) + rm_host)
    if suggest and not plan.fits:
        plan.suggestions = suggestions(cfg, shape, hardware, strategy, images_per_prompt, plan, reward_models,
                                       videos_per_prompt)
    return plan


@dataclass(frozen=True)
class MicroBatchSize:
    """What one training micro-batch holds at most, as the activation terms count it."""

    tokens: int  # the forward's tokens
    vision_patches: int
    rows: int
    prompt_tokens: int
    completion_tokens: int
    what: str  # how it was bounded, for the plan's notes


def micro_batch_size(cfg, shape: ModelShape, world: int, patches: int, seq_len: int) -> MicroBatchSize:
    """The largest micro-batch a rank trains on: bounded by `train.max_tokens_per_micro_batch` when set, else by
    `train.micro_batch_completions_per_rank` rows over the prompts they come from. `patches`: vision patches per
    prompt; `seq_len`: a trajectory's tokens."""
    r, t, d = cfg.rollout, cfg.train, cfg.data
    if t.max_tokens_per_micro_batch > 0:
        # A token budget bounds the forward's tokens, not its rows (a row longer than the budget runs alone). Each
        # prompt's vision tokens count in the budget (merge^2 patches each), which so bounds the patches too.
        tokens = max(t.max_tokens_per_micro_batch, seq_len)
        prompts = max(1, cfg.prompts_per_step // world)
        vision = min(prompts * patches, tokens * shape.vision.spatial_merge_size ** 2)
        what = f"token budget {tokens} tokens per micro-batch (train.max_tokens_per_micro_batch)"
        completion_tokens = tokens  # short completions of many rows can fill the budget
        prompt_tokens = min(prompts * d.max_prompt_length, tokens)
        rows = min(prompts * r.n, tokens)  # at most the rank's rows, one token each at least
    else:
        # The shared-prompt forward runs each distinct prompt once and the rows' completions after it; a micro-batch's
        # rows come from ceil(rows / n) groups, one more when it starts inside a group (rows left out, filtering).
        rows = t.micro_batch_completions_per_rank
        prompts = min(rows, -(-rows // max(1, r.n)) + (1 if rows > 1 else 0))
        tokens = prompts * d.max_prompt_length + rows * r.tokens_after_prompt
        vision = prompts * patches
        what = (f"micro-batch of {rows} rows: {prompts} prompt(s) of {d.max_prompt_length} tokens, once each, and "
                f"{rows} x {r.tokens_after_prompt} after them")
        completion_tokens = rows * r.tokens_after_prompt
        prompt_tokens = prompts * d.max_prompt_length
    return MicroBatchSize(tokens, vision, rows, prompt_tokens, completion_tokens, what)


def engine_components(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice, hi: int, patches: int,
                      seq_len: int) -> tuple[list[Component], int | None, int | None]:
    """The rollout engine's memory (its KV cache, weights, prefill), and for vLLM/SGLang the KV bytes it has and
    needs for one sequence (None for the hf engine). `hi`: bytes of the compute dtype; `patches`: vision patches per
    prompt; `seq_len`: a trajectory's tokens."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    world, params = hardware.world_size, shape.num_parameters
    rollout, train = ("rollout",), ("train",)
    kv_avail = kv_needed = None
    comps: list[Component] = []
    if r.engine == "hf":
        prompts = cfg.prompts_per_step // world
        rows = prompts * r.n
        # How the engine samples this family (vlrft.sampling.hf_decoder, which the engine reads too): the lean group
        # decoder (SDPA/eager attention, Qwen2/2.5/3-VL text decoders; plain LoRA it reads), the group decoder through
        # transformers' layers, or transformers' `generate` (families without an M-RoPE rule).
        decoder = hf_decoder(shape.model_type, r.lean_decode, m.attn_implementation)
        lean = decoder == "lean"
        # Under bf16 autocast over float32 weights the lean decode step keeps its KV cache in bf16; transformers'
        # layers (and `generate`) keep the keys in float32 (rotated by the float32 residual stream's cos/sin) and the
        # values in bf16.
        if hi == 2:
            kv_dtype = ("bf16", 2, 2) if lean else ("float32-key, bf16-value", 4, 2)
        else:
            kv_dtype = ("float32", 4, 4)
        per_token = shape.text.num_layers * shape.text.kv_dim * (kv_dtype[1] + kv_dtype[2])
        # each prompt held once for its group; with tools, turns after the first decode each row alone (n = 1)
        if lean and shares_prompt(r.n, d.max_prompt_length) and not r.tools:
            kv = (prompts * d.max_prompt_length + rows * r.tokens_after_prompt) * per_token
            what = (f"the rank's {prompts} prompts x {d.max_prompt_length} tokens once, {rows} rollouts x "
                    f"{r.tokens_after_prompt} tokens each")
        else:
            kv = rows * seq_len * per_token
            what = f"the rank's {rows} rollouts x {seq_len} tokens, each row its own prompt"
        how = {"lean": "lean group decoder", "transformers_layers": "group decoder through transformers' layers",
               "generate": "transformers' generate"}[decoder]
        comps.append(Component("engine_kv_cache", kv, rollout, f"hf engine ({how}): {kv_dtype[0]} KV cache of {what}"))
        whole, note = hf_engine_weights(params, strategy)
        if whole:
            comps.append(Component("engine_weights", whole, rollout, note))
        text_layer, vision_layer = _per_token_layer_bytes(shape, hi)
        if decoder == "generate":
            # `generate` gets all the rank's prompts in one call (max_batch_prompts), encodes their images once, then
            # repeats every prompt n times and prefills the rows together: a layer's activations of every row's
            # prompt; its first logits are of the last position only (logits_to_keep=1), and each step keeps a few
            # [rows, vocabulary] float32 score tensors (logits, processed scores, the recorder's log-softmax, probs)
            prefill = max(rows * d.max_prompt_length * text_layer, prompts * patches * vision_layer)
            comps.append(Component("engine_prefill", prefill, rollout,
                                   f"hf engine (transformers' generate): the prefill of the rank's {prompts} prompts "
                                   f"repeated {r.n} times ({rows} rows of {d.max_prompt_length} tokens at once), a "
                                   "layer at a time"))
            comps.append(Component("engine_scores", generate_scores_bytes(shape, rows), rollout,
                                   f"hf engine (transformers' generate): {GENERATE_SCORE_COPIES} float32 score "
                                   f"tensors of {rows} rows x {shape.text.vocab_size} vocabulary per step"))
        else:
            # the prefill of the rank's prompts, PREFILL_TOKENS at a time: one layer's activations at a time, of the
            # vision tower's patches or of the text layers' tokens
            at_once = max(1, min(prompts, PREFILL_TOKENS // max(1, d.max_prompt_length)))  # prompts per prefill call
            prefill = at_once * max(d.max_prompt_length * text_layer, patches * vision_layer)
            comps.append(Component("engine_prefill", prefill, rollout,
                                   f"hf engine: the prefill of {at_once} of the rank's {prompts} prompts at once "
                                   f"(rollout prefills {PREFILL_TOKENS} tokens at a time), a layer at a time"))
    elif r.engine == "vllm_server":
        pass  # the servers have GPUs of their own: these GPUs hold the training side only
    else:
        budget = int(r.gpu_memory_utilization * hardware.gpu_memory)
        engine_bytes = 4 if m.dtype == "float32" else 2  # the engine is given model.dtype (weights and KV cache)
        weights = engine_bytes * params // r.tensor_parallel_size
        kv_avail = budget - weights - 1 * GiB  # vLLM keeps about 1 GiB for its own activations
        max_len = r.engine_max_len(d.max_prompt_length)
        kv_needed = max_len * kv_bytes_per_token(shape, engine_bytes) // r.tensor_parallel_size
        comps.append(Component("engine_weights", weights, rollout,
                               f"{r.engine}: {m.dtype} weights / tensor_parallel_size {r.tensor_parallel_size}"))
        comps.append(Component("engine_kv_cache", budget - weights, rollout,
                               f"{r.engine}: the rest of gpu_memory_utilization={r.gpu_memory_utilization} "
                               "(KV cache and engine activations)"))
        if not r.sleep_between_steps:
            comps.append(Component("engine_awake_in_training", budget, train,
                                   "rollout.sleep_between_steps=false: the engine keeps its memory while training"))
    return comps, kv_avail, kv_needed


# ------------------------------------------------------------------ what to change


def _with(cfg, section: str, **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def suggestions(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice, images_per_prompt: int,
                plan: MemoryPlan, reward_models: Sequence[RewardModelShape] = (), videos_per_prompt: int = 0
                ) -> list[str]:
    """One line per single change that helps, best first; each says the per-GPU total it would give."""

    def trial(c=cfg, s=strategy, h=hardware, rms=reward_models) -> MemoryPlan:
        return plan_memory(c, shape, h, s, images_per_prompt, suggest=False, reward_models=rms,
                           videos_per_prompt=videos_per_prompt)

    out: list[tuple[bool, int, str]] = []

    def add(text: str, p: MemoryPlan) -> None:
        if p.total < plan.total or (p.engine_ok and not plan.engine_ok):
            verdict = "fits" if p.fits else "still too much"
            out.append((not p.fits, p.total, f"{text} (-> {_gib(p.total)} per GPU, {verdict})"))

    resident = [rm.key for rm in reward_models if not rm.offload]
    if resident:
        add(f"set offload: true in the kwargs of reward model(s) {', '.join(resident)}",
            trial(rms=[dataclasses.replace(rm, offload=True) for rm in reward_models]))
    if not cfg.model.gradient_checkpointing:
        add("set model.gradient_checkpointing: true", trial(c=_with(cfg, "model", gradient_checkpointing=True)))
    if strategy.name in ("single", "ddp") and hardware.world_size > 1:
        add("set train.strategy: fsdp2", trial(s=dataclasses.replace(strategy, name="fsdp2")))
        add("set train.strategy: deepspeed with ZeRO-3",
            trial(s=dataclasses.replace(strategy, name="deepspeed", zero_stage=3)))
    if strategy.name in ("single", "ddp"):
        add("set train.strategy: fsdp2 with train.fsdp.cpu_offload: true",
            trial(s=dataclasses.replace(strategy, name="fsdp2", offload_optimizer=True, offload_params=True)))
    if strategy.name == "deepspeed" and strategy.zero_stage < 3:
        add("use ZeRO stage 3 (train.deepspeed.zero_stage: 3)", trial(s=dataclasses.replace(strategy, zero_stage=3)))
    if not strategy.offload_optimizer and strategy.name in ("fsdp2", "deepspeed"):
        key = "train.fsdp.cpu_offload: true" if strategy.name == "fsdp2" else "train.deepspeed.offload_optimizer: true"
        add(f"offload to the CPU ({key})", trial(s=dataclasses.replace(strategy, offload_optimizer=True)))
    budget = cfg.train.max_tokens_per_micro_batch
    seq_len = cfg.data.max_prompt_length + cfg.rollout.tokens_after_prompt
    while budget > seq_len:  # with a token budget the rows do not bound a forward; the budget does
        budget = max(seq_len, budget // 2)
        p = trial(c=_with(cfg, "train", max_tokens_per_micro_batch=budget))
        if p.fits or budget == seq_len:
            add(f"lower train.max_tokens_per_micro_batch to {budget}", p)
            break
    mb = cfg.train.micro_batch_completions_per_rank if not cfg.train.max_tokens_per_micro_batch else 1
    while mb > 1:
        mb //= 2
        p = trial(c=_with(cfg, "train", micro_batch_completions_per_rank=mb))
        if p.fits or mb == 1:
            add(f"lower train.micro_batch_completions_per_rank to {mb}", p)
            break
    r = cfg.rollout
    if r.engine not in ("hf", "vllm_server"):
        rollout_free = plan.capacity - (plan.phase_total("rollout") - plan.component("engine_weights")
                                        - plan.component("engine_kv_cache"))
        best = int(100 * rollout_free / plan.capacity) / 100
        if 0 < best < r.gpu_memory_utilization:
            add(f"lower rollout.gpu_memory_utilization to {best:.2f}",
                trial(c=_with(cfg, "rollout", gpu_memory_utilization=best)))
        if not plan.engine_ok:
            for tp in (2, 4, 8):
                if tp > r.tensor_parallel_size and hardware.gpus_per_node % tp == 0:
                    add(f"raise rollout.tensor_parallel_size to {tp}",
                        trial(c=_with(cfg, "rollout", tensor_parallel_size=tp)))
                    break
    for nodes in (hardware.nodes * 2, hardware.nodes * 4):
        p = trial(h=dataclasses.replace(hardware, nodes=nodes))
        if p.fits and strategy.name not in ("single", "ddp"):
            add(f"use {nodes} nodes of {hardware.gpus_per_node} GPUs", p)
            break
    out.sort(key=lambda item: (item[0], item[1]))
    return [text for _, _, text in out]


def format_plan(plan: MemoryPlan) -> str:
    """The human-readable table `vlrft plan` prints."""
    hw = plan.hardware
    lines = [f"model        {plan.model}: {plan.parameters / 1e9:.3f} B parameters "
             f"({plan.trainable / 1e9:.3f} B trained)",
             f"hardware     {hw.nodes} node(s) x {hw.gpus_per_node} GPUs x {_gib(hw.gpu_memory)} "
             f"= {hw.world_size} ranks; strategy {plan.strategy}", "",
             f"{'per GPU':<26}{'bytes':>12}  {'phase':<15}note"]
    for c in plan.components:
        phases = "+".join(c.phases)
        lines.append(f"  {c.name:<24}{_gib(c.bytes):>12}  {phases:<15}{c.note}")
    for phase in PHASES:
        if phase != "load" or any(phase in c.phases and c.name != "cuda_reserve" for c in plan.components):
            lines.append(f"  {'total while ' + phase:<24}{_gib(plan.phase_total(phase)):>12}")
    if plan.engine_kv_bytes is not None:
        lines.append(f"  engine KV cache {_gib(plan.engine_kv_bytes)} available, {_gib(plan.engine_kv_needed)} "
                     "needed for one sequence of max_model_len tokens")
    if plan.host:
        lines += ["", f"{'host memory, first node':<26}{'bytes':>12}  {'phase':<20}note"]
        for c in plan.host:
            lines.append(f"  {c.name:<24}{_gib(c.bytes):>12}  {'+'.join(c.phases):<20}{c.note}")
        lines.append("  " + ", ".join(f"{phase} {_gib(plan.host_total(phase))}" for phase in PHASES)
                     + " (the policy's part; processes and page cache come on top)")
    lines += [f"not counted: {what}" for what in plan.not_counted]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += ["", f"{verdict}: peak {_gib(plan.total)} ({plan.peak_phase}) of {_gib(plan.capacity)} per GPU"]
    if plan.suggestions:
        lines.append("to make it fit, change one of:")
        lines += [f"  - {s}" for s in plan.suggestions]
    return "\n".join(lines)

"""Where a trained model's parameters, gradients and optimizer state sit under each strategy: on the GPU, and in the
first node's host memory (the checkpoint read, CPU offload)."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.families import family
from vlrft.plan.architecture import ModelShape
from vlrft.plan.memory_plan import STRATEGIES, Component, Hardware, StrategyChoice

DEEPSPEED_BUCKET_ELEMENTS = 5 * 10 ** 8  # DeepSpeed's default reduce_bucket_size / allgather_bucket_size


@dataclass(frozen=True)
class ModelState:
    """Resident bytes of one trained model (policy or critic) under a strategy."""

    parameters: int
    gradients: int
    optimizer: int
    buffers: int  # DDP gradient buckets / DeepSpeed communication buckets (resident)
    gathered: int  # transient: bf16 layers gathered for compute (sharded strategies), train phase
    notes: dict
    resident_gradients: bool = False  # allocated once and never freed (ZeRO-3), not only while training
    resident_buffers: bool = True  # False: allocated for each backward and freed after it (ZeRO-2's bucket)


def trains_sharing_prompts(shape: ModelShape) -> bool:
    """Whether the family's training forward runs each distinct prompt once for its rows (`vlrft.families`; else
    every row in full)."""
    shares = family(shape.model_type)
    return shares is not None and shares.training_shares_prompt.supported


def fsdp2_gathered_bytes(shape: ModelShape, compute_bytes: int, head_trains: bool = True) -> int:
    """What FSDP2 holds unsharded in the backward beside a micro-batch's activations, in `compute_bytes` (its
    `param_dtype`): the root unit (embeddings, LM head, norms, merger), gathered through forward and backward; two
    decoder layers (the one computing and the last all-gather's output, which FSDP2 keeps until the next one); the
    float32 copy of a layer's gradient its reduce-scatter reads (kept until the next layer's); and, when the root
    trains, the LM head's unsharded gradient (made first in the backward, reduced with the root's at its end; tied,
    it is the embeddings', which autograd holds until their own arrive at the end). Where the family's training
    forward shares prompts, also the embeddings' gradient from the completion calls, alive through the prompt pass's
    backward (`vlrft.models.staged_backward`). The root's other gradients come at the backward's end, when the
    activations are gone. Measured on 2 CPU ranks by bench/bench_plan_fsdp2.py."""
    matrices = (1 if shape.tie_word_embeddings else 1 + int(trains_sharing_prompts(shape))) if head_trains else 0
    matrix = shape.text.vocab_size * shape.text.hidden_size
    return (compute_bytes * (shape.blocks()["root"] + matrices * matrix)
            + (2 * compute_bytes + 4) * shape.largest_layer())


def model_state(params: int, trainable: int, shape: ModelShape, s: StrategyChoice, world: int) -> ModelState:
    hi = 2 if s.mixed_precision else 4  # low-precision compute bytes
    if s.name in ("single", "ddp"):
        buckets = 4 * trainable if s.name == "ddp" and world > 1 else 0
        return ModelState(4 * params, 4 * trainable, 8 * trainable, buckets, 0, {
            "parameters": "float32, replicated on every GPU", "gradients": "float32, replicated",
            "optimizer": "AdamW moments (2 x float32), replicated",
            "buffers": "DDP gradient buckets (a float32 copy of the gradients)"})
    if s.name == "fsdp2":
        offload = s.offload_optimizer or s.offload_params  # FSDP2's CPUOffloadPolicy moves all three
        shard = 0 if offload else 1
        gathered = fsdp2_gathered_bytes(shape, hi, head_trains=trainable >= params - shape.tower_count())
        return ModelState(shard * 4 * params // world, shard * 4 * trainable // world,
                           shard * 8 * trainable // world, 0, gathered, {
            "parameters": f"float32 shards (1/{world})" + (" on the CPU" if offload else ""),
            "gradients": f"float32 shards (1/{world})" + (" on the CPU" if offload else ""),
            "optimizer": f"AdamW moments, sharded (1/{world})" + (" on the CPU" if offload else ""),
            "gathered": "gathered for compute: the root (embeddings, LM head) and two decoder layers, the LM head's "
                        "gradient and a layer's float32 gradient for its reduce-scatter"})
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
        return ModelState(param_bytes, grads, opt, buckets, gathered, {
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


def offloaded_during_rollout(cfg, strategy: StrategyChoice) -> bool:
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
    elif offloaded_during_rollout(cfg, strategy):
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


"""FSDP2: parameters, gradients and optimizer state sharded over all ranks (`torch.distributed.fsdp.fully_shard`).

Each decoder layer and vision block (the classes a transformers model lists in `_no_split_modules`)
is its own shard unit, gathered just before it runs and freed after; the rest (embeddings, final
norm, LM head, vision merger) belongs to the root unit, the `ActorVL`/`CriticVL` the trainer
calls. On GPUs the gathered weights are cast to `model.dtype` and gradients reduced in float32
(`MixedPrecisionPolicy`); `train.fsdp.cpu_offload` keeps the shards in host memory.

Loading: rank 0 alone reads the checkpoint; every rank builds the model on the meta device, shards
it, then receives its shards from rank 0 (`set_model_state_dict(..., broadcast_from_rank0=True)`).
Buffers that are not in the state dict (rotary `inv_freq`) are broadcast from rank 0 too. With LoRA
(adapters are injected after loading) rank 0's model stays real until it is sharded, so its adapters are
made there; its state (base and adapters) is what reaches every rank's shards.

Checkpoints: `sharded/` is a `torch.distributed.checkpoint` folder (every rank writes its shards of
the model and optimizer state); it can be read back by any number of processes, which reshards.
`model/` is the policy gathered into Hugging Face format for `from_pretrained`.

Every rank must run the same forwards: a unit's all-gather is a collective. The trainer's
micro-batch counts are equal on every rank; a micro-batch without images runs the vision blocks on
a dummy image when another rank's has images (`vlrft.models.vision_balance`; in multi-turn
training also the continuation pass that encodes tool images); generation (hf engine) gathers the
whole policy first (`generation`) so ranks can decode different lengths independently, once for
all the turns of a multi-turn rollout (ranks' trajectories take different numbers of turns).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vlrft.parallel.hf_export import save_gathered
from vlrft.parallel.strategy import MakeOptimizer, ModelSource, ProcessGroupStrategy, RankInfo, TrainedModel, uses_nccl
from vlrft.errors import UserError
from vlrft.models import precision

SHARDED_DIR = "sharded"
ADAPTERS_TO_COME = "adapters to come"  # `_pending` marker: rank 0's state is taken when the model (with LoRA) is sharded


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one: instances of the classes any submodule lists in `_no_split_modules`.

    Those are the transformer blocks (decoder layers, vision blocks) of every transformers model,
    found by name so no architecture is hard-coded. Innermost first, so nested units shard before
    their parents.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    return units[::-1]


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) holding one Parameter (tied weights: embeddings and LM head), by identity.
    `Module.to` / `to_empty` may give each slot a Parameter of its own; transformers' `tie_weights` cannot re-tie a
    LoRA-wrapped LM head (its `weight` is a read-only property), so the slots are re-pointed instead (`_retie`)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for (first, first_name), *others in groups:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


def _hf_model(module: nn.Module) -> nn.Module:
    """The transformers model inside an ActorVL / CriticVL / PEFT wrapper (whose state dict rank 0 loaded)."""
    from vlrft.models.weights import policy_module

    if hasattr(module, "actor_like"):  # CriticVL
        module = module.actor_like
    return policy_module(module)


class FSDP2Strategy(ProcessGroupStrategy):
    """`fully_shard` per transformer block and at the root; gloo on CPU, NCCL on GPUs."""

    name = "fsdp2"
    reshards_checkpoints = True
    checkpoint_holds_weights = True  # sharded/
    balances_vision_calls = True  # a rank without images runs the vision blocks on a dummy (their all-gathers)

    def __init__(self, info: RankInfo | None = None, cfg=None):
        super().__init__(info, cfg)
        from torch.distributed.device_mesh import init_device_mesh

        from vlrft.config import FSDPConfig

        self.options = cfg.train.fsdp if cfg is not None else FSDPConfig()
        self.compute_dtype = precision.compute_dtype(self.device, cfg.model.dtype) if cfg is not None else torch.float32
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Rank 0's full state dict (and buffers) of each model loaded on the meta device, by id(model); with LoRA,
        # ADAPTERS_TO_COME until `_shard` takes rank 0's state (adapters included).
        self._pending: dict[int, tuple[dict, dict] | str] = {}
        self._generating = 0
        self.offload_during_rollout = self.options.offloads_during_rollout(
            cfg.rollout.engine if cfg is not None else "hf", on_gpu=self.device.type == "cuda")
        self._offloaded = None

    # ------------------------------------------------------------------ loading

    def load_model(self, source: ModelSource, *, trainable: bool) -> nn.Module:
        """Every rank builds the model on the meta device; rank 0 also reads the weights (on CPU).

        The weights reach the other ranks, shard by shard, when the model is prepared. With `source.adapters` (LoRA,
        added by the caller next) rank 0's model is the one it read, on the CPU, so that its adapters are made there
        from its random state; `_shard` takes its state (base and adapters) and broadcasts it into every rank's shards,
        as without adapters. No GPU ever holds the whole model.
        """
        from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

        from vlrft.models.loading import DTYPES, adapter_base, load_policy

        dtype = DTYPES.get(source.dtype, torch.float32)
        # a LoRA adapter folder (a LoRA run's checkpoint model/) has no config of its own: rank 0 merges it into its
        # base, whose architecture the meta model takes
        config_path = adapter_base(source.path) or str(source.path)
        config = AutoConfig.from_pretrained(config_path, trust_remote_code=source.trust_remote_code)
        if source.adapters and self.is_main:
            model = load_policy(source.path, dtype=source.dtype, attn_implementation=source.attn_implementation,
                                trust_remote_code=source.trust_remote_code, device="cpu")
            self._pending[id(model)] = ADAPTERS_TO_COME
            return model
        # Only rank 0 reads the checkpoint; before from_config sets config.dtype to the model's.
        read_dtype = _read_dtype(source, config) if self.is_main else source.dtype
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(
                config, dtype=dtype, attn_implementation=source.attn_implementation,
                trust_remote_code=source.trust_remote_code)
        with contextlib.suppress(OSError, ValueError):  # the stop tokens the engines use come from here
            model.generation_config = GenerationConfig.from_pretrained(config_path)
        full, buffers = {}, {}
        if self.is_main:
            loaded = load_policy(source.path, dtype=read_dtype, device="cpu",
                                 attn_implementation=source.attn_implementation,
                                 trust_remote_code=source.trust_remote_code)
            full, buffers = loaded.state_dict(), dict(loaded.named_buffers())
        self._pending[id(model)] = ADAPTERS_TO_COME if source.adapters else (full, buffers)
        return model

    def _materialise(self, hf_model: nn.Module) -> None:
        """Give a sharded meta model its weights (rank 0's, broadcast) and its buffers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full, buffers = self._pending.pop(id(hf_model))
        # Allocate this rank's shards (uninitialised) first: loading then copies each broadcast tensor's
        # slice into them, so a rank never holds more than its shards plus one full tensor.
        tied = _tied_slots(hf_model)
        hf_model.to_empty(device="cpu" if self.options.cpu_offload else self.device)
        _retie(tied)
        set_model_state_dict(hf_model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # Buffers are not sharded and non-persistent ones (rotary inv_freq) are not in the state dict.
        device = self.device if uses_nccl() else torch.device("cpu")
        meta = {name: (tuple(b.shape), b.dtype) for name, b in hf_model.named_buffers()}
        for name in sorted(meta):
            shape, dtype = meta[name]
            value = buffers[name].to(device=device, dtype=dtype) if self.is_main else \
                torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(value, src=0)
            owner, _, leaf = name.rpartition(".")
            hf_model.get_submodule(owner)._buffers[leaf] = value.to(self.device)

    # ------------------------------------------------------------------ wrapping

    def _shard(self, root: nn.Module, hf_model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        options: dict = dict(mesh=self.mesh, reshard_after_forward=self.options.reshard_after_forward)
        if self.options.mixed_precision and self.compute_dtype != torch.float32:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.options.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        pending = id(hf_model) in self._pending
        if pending and self._pending[id(hf_model)] is ADAPTERS_TO_COME:
            # rank 0's model is real (its base and its freshly made adapters), the others' on the meta device: rank 0's
            # state is what `_materialise` broadcasts, and its model goes to the meta device like theirs
            full, buffers = {}, {}
            if self.is_main:
                full, buffers = hf_model.state_dict(), dict(hf_model.named_buffers())
                tied = _tied_slots(hf_model)
                hf_model.to("meta")  # a new Parameter per module, so tied weights part: tied again, as on the others
                _retie(tied)
            self._pending[id(hf_model)] = (full, buffers)
        if not pending:
            self._broadcast_from_rank0(root)
        for unit in shard_units(root):
            fully_shard(unit, **options)
        fully_shard(root, **options)
        if pending:
            self._materialise(hf_model)
        return root

    def _broadcast_from_rank0(self, model: nn.Module) -> None:
        """Make every rank's (whole, not yet sharded) weights rank 0's, as DDP does when it wraps: a model that was
        not loaded through the meta device (a critic's value head is made on each rank; the meta path fills it).
        """
        on_cpu = not uses_nccl()
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_meta:
                    continue
                staged = tensor.detach().to("cpu") if on_cpu and tensor.device.type != "cpu" else tensor.detach()
                dist.broadcast(staged, src=0)
                if staged is not tensor:
                    tensor.copy_(staged)

    def prepare_trainable(self, model: nn.Module, make_optimizer: MakeOptimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.stage_backwards(model)  # each call's post-backward reduces its gradients: none wait
        root = self._shard(model, _hf_model(model))
        return root, make_optimizer([p for p in root.parameters() if p.requires_grad])

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        return self._shard(model, _hf_model(model))

    @contextlib.contextmanager
    def generation(self, model: nn.Module) -> Iterator[None]:
        """Gather the whole model on every rank (one collective per unit), generate locally, then reshard.

        Decoding runs a different number of forwards on each rank, which per-unit all-gathers could
        not survive; with every unit gathered and kept, forwards need no collective.
        """
        units = _fsdp_modules(model)
        if self._generating or not units:
            self._generating += 1
            try:
                yield
            finally:
                self._generating -= 1
            return
        root = units[0]
        root._get_fsdp_state()._lazy_init()  # make `model` the root before any child runs forward
        self._generating += 1
        try:
            for unit in units:
                unit.set_reshard_after_forward(False)
                unit.unshard()
            yield
        finally:
            self._generating -= 1
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(self.options.reshard_after_forward)

    # ------------------------------------------------------------------ memory during rollout

    def offload_to_cpu(self, parts, frozen) -> None:
        """This rank's shards, gradients and optimizer state (and the frozen models' shards) to host memory.

        With `train.fsdp.cpu_offload` they live there already; only the CUDA cache is emptied.
        """
        from vlrft.parallel.offload import RolloutOffload

        if self.options.cpu_offload:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        self._offloaded = RolloutOffload([p.module for p in parts], [p.optimizer for p in parts],
                                         [m for m in frozen if m is not None], self.device)
        self._offloaded.to_host()

    def reload_to_device(self, parts, frozen) -> None:
        if self._offloaded is not None:
            self._offloaded.to_device()
            self._offloaded = None

    # ------------------------------------------------------------------ gradients
    # `no_sync` is the base strategy's (nothing): every micro-batch's gradients are reduce-scattered and added to
    # the sharded gradient. FSDP2's `set_requires_gradient_sync(False)` would save those collectives, but it keeps
    # the unreduced gradients on the unsharded parameters, whole and in float32, on every GPU, and with
    # `cpu_offload` too: +31 GiB per GPU for a 7B model, 125 GiB for 32B. Sharded accumulation is what
    # `vlrft plan` counts (gradients 1/world) and gives the same sum.

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, folder: Path, parts: dict[str, TrainedModel], hf_model: nn.Module, processor,
                        export_hf: bool = True, hf_dtype: torch.dtype | None = None) -> None:
        """`sharded/` (DCP: every rank's shards of every part and its optimizer) and, when `export_hf`, `model/`
        (HF format in `hf_dtype`, written by rank 0 a bucket at a time)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = {}
        for name, part in parts.items():
            model_state, optim_state = get_state_dict(part.module, part.optimizer, options=_trained_only())
            state[name] = {"model": model_state, "optimizer": optim_state}
        dcp.save(state, checkpoint_id=str(folder / SHARDED_DIR))
        if export_hf:
            save_gathered(hf_model, processor, folder / "model", is_main=self.is_main, gather=self.gathered,
                          dtype=hf_dtype)

    def check_resumable(self, folder: Path, saved_world_size: int) -> None:
        if not (folder / SHARDED_DIR / ".metadata").is_file():
            raise UserError(f"no FSDP2 checkpoint in '{folder / SHARDED_DIR}'; resume a checkpoint written with "
                            "train.strategy=fsdp2 (a ddp/single or DeepSpeed one resumes with its own strategy), or "
                            "start without train.resume")

    def load_checkpoint(self, folder: Path, parts: dict[str, TrainedModel]) -> None:
        """Read `sharded/` into this run's shards, whatever number of processes wrote it."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from vlrft.parallel.safe_checkpoint import dcp_load

        self.check_resumable(folder, saved_world_size=self.world_size)
        state = {}
        for name, part in parts.items():
            model_state, optim_state = get_state_dict(part.module, part.optimizer, options=_trained_only())
            state[name] = {"model": model_state, "optimizer": optim_state}
        dcp_load(state, folder / SHARDED_DIR)  # nothing a planted file names runs
        for name, part in parts.items():
            set_state_dict(part.module, part.optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optimizer"], options=_trained_only())


def _trained_only():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (a LoRA policy's base, a frozen vision tower) never change: a resume reads them from model.path
    # (`Strategy.checkpoint_holds_weights`). Saving them would put the whole float32 base into every LoRA checkpoint
    # (288 GB for 72B). strict=False: the state asked for and set lacks exactly those frozen weights.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _read_dtype(source: ModelSource, config) -> str:
    """The dtype rank 0 reads the checkpoint in: the checkpoint's own where it is narrower than `source.dtype`.

    A bfloat16 release trained with float32 weights is read in bfloat16 (half the bytes in rank 0's host memory);
    `set_model_state_dict` casts each broadcast tensor into the float32 shards, which is exact. The checkpoint's
    dtype is the widest floating dtype among the tensors of a local folder's safetensors files (their headers),
    else its config's (top level or `text_config`, as Qwen3-VL writes it). A LoRA adapter folder is merged into its
    base in `source.dtype`, as before.
    """
    from vlrft.models.loading import DTYPES, adapter_base, stored_dtype_name

    wanted = DTYPES.get(source.dtype, torch.float32)
    folder = Path(source.path)
    if folder.is_dir() and adapter_base(folder) is not None:
        return source.dtype
    stored = stored_dtype_name(folder, config)
    return stored if DTYPES[stored].itemsize < wanted.itemsize else source.dtype

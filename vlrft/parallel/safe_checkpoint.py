"""Reading FSDP2 (`torch.distributed.checkpoint`) and DeepSpeed checkpoints without running code from them.

Both libraries unpickle parts of a checkpoint unchecked: DCP its `.metadata` (`pickle.load`) and every non-tensor
value (`torch.load(weights_only=False)`, an optimizer's hyper-parameters), DeepSpeed each rank's `*.pt` file. A
planted file would run its code on resume. Here DCP reads through a storage reader and a planner that take only
plain data and the classes DCP's metadata is made of; DeepSpeed's files are each read first with
`torch.load(weights_only=True)` (memory-mapped: the tensors' bytes are not read) and an allow-list of the few
DeepSpeed types they hold, so DeepSpeed's own reader only ever sees files that passed.
"""

from __future__ import annotations

from pathlib import Path

from vlrft.errors import UserError
from vlrft.safe_load import load_plain_pickle, load_torch

_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
DCP_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES}
    | {("torch", name) for name in (*_DTYPES, "Size")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
       ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
       ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")})


def dcp_load(state: dict, folder: Path) -> None:
    """`torch.distributed.checkpoint.load(state, folder)` that runs nothing a file names: `.metadata` through a
    restricted unpickler, non-tensor values through `torch.load(weights_only=True)` (tensors already are)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            metadata = load_plain_pickle(path, what="FSDP2 checkpoint metadata", allowed=DCP_METADATA_GLOBALS)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_torch(value, what="FSDP2 checkpoint value", name=f"{folder}: {fqn}")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    # checked here first: DCP would bury the one-line refusal in a CheckpointException with every rank's traceback
    load_plain_pickle(folder / ".metadata", what="FSDP2 checkpoint metadata", allowed=DCP_METADATA_GLOBALS)
    try:
        dcp.load(state, storage_reader=Reader(str(folder)), planner=Planner())
    except CheckpointException as exc:
        for failure in exc.failures.values():  # (exception, traceback summary) per rank
            original = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(original, UserError):
                raise original from None
        raise


def deepspeed_globals() -> list:
    """The DeepSpeed types its checkpoint files hold (besides tensors and containers): the ZeRO stage enum, ZeRO-2's
    fragment addresses and the loss scaler's state object."""
    kinds = []
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        kinds.append(ZeroStageEnum)
    except ImportError:
        pass
    try:  # ZeRO-2's optimizer states hold the flat-buffer fragment addresses (a plain dataclass of two ints)
        from deepspeed.utils.tensor_fragment import fragment_address

        kinds.append(fragment_address)
    except ImportError:
        pass
    try:
        from deepspeed.runtime.fp16 import loss_scaler

        kinds += [getattr(loss_scaler, n) for n in ("LossScaler", "DynamicLossScaler") if hasattr(loss_scaler, n)]
    except ImportError:
        pass
    return kinds


def check_deepspeed_files(folder: Path) -> None:
    """Read every `*.pt` under `folder` (a DeepSpeed checkpoint) safely before DeepSpeed reads it unchecked:
    `UnsafeFileError` names a file holding anything but data, `DamagedFileError` a truncated one."""
    allowed = deepspeed_globals()
    for path in sorted(Path(folder).rglob("*.pt")):
        load_torch(path, what="DeepSpeed checkpoint file", allowed=allowed, mmap=True)

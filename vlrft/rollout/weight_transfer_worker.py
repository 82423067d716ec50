"""The vLLM-side half of the "vlrft_shm" weight-transfer backend: runs inside every vLLM worker process.

vLLM's factory imports this module (registered by `vlrft.rollout.weight_transfer.register`, our
`vllm.general_plugins` entry point) when a server started with `--weight-transfer-config
'{"backend": "vlrft_shm"}'` gets `/init_weight_transfer_engine`; the training processes never import it.
Each `/update_weights` names one safetensors file the trainer wrote (a bucket of checkpoint-named
tensors); the engine reads it and loads each tensor through the model's own `load_weights` inside
vLLM's checkpoint-format layerwise reload (opened at `/start_weight_update`, closed at
`/finish_weight_update`), so each layer's post-load processing (the CPU backend's oneDNN packing,
quantisation) runs on the new weights. What it could not load is reported, never raised mid update
(see `vlrft.rollout.weight_transfer`, "Accounting").
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from typing import Any

import torch


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


class ShmEngineMethods:
    """Checkpoint-format buckets from safetensors files, loaded through vLLM's layerwise reload: the methods of
    `ShmWeightTransferEngine`, which adds vLLM's `WeightTransferEngine` base when vLLM's factory asks for it."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info: ShmInitInfo | None = None
        self._reset()

    def _reset(self) -> None:
        self.sync: int | None = None
        self.received = 0
        self.unconsumed: dict[str, str] = {}  # name -> why
        self.loaded: set[str] = set()  # vLLM parameter names load_weights reported

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if not os.path.isdir(init_info.folder):
            raise ValueError(f"vlrft_shm: folder {init_info.folder!r} does not exist on this server's host")
        self.init_info = init_info

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.init_info is None:
            raise RuntimeError("vlrft_shm: /init_weight_transfer_engine first")
        self._reset()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # a GPU copy may still be in flight; vLLM's CPU build has none
            torch.accelerator.synchronize()

    def receive_weights(self, info: ShmUpdateInfo) -> None:
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        assert self.init_info is not None
        self.sync = info.sync
        self.received += len(info.names)
        path = os.path.join(self.init_info.folder, os.path.basename(info.file))
        try:
            tensors = load_file(path, device=str(self.device))
        except Exception as err:  # noqa: BLE001 - accounted below, never raised mid update
            self.unconsumed.update({n: f"bucket {info.file} unreadable: {err}" for n in info.names})
            return
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
                tensor = tensors.pop(name, None)
                if tensor is None:
                    self.unconsumed[name] = f"not in {info.file}"
                elif str(tensor.dtype).removeprefix("torch.") != dtype_name or list(tensor.shape) != shape:
                    self.unconsumed[name] = f"{tensor.dtype} {list(tensor.shape)} in the file, " \
                                            f"announced {dtype_name} {shape}"
                else:
                    try:
                        loaded = self.model.load_weights([(name, tensor)])
                    except Exception as err:  # noqa: BLE001 - e.g. "There is no module or parameter named"
                        self.unconsumed[name] = f"load_weights refused it: {str(err)[:200]}"
                        continue
                    if loaded:
                        self.loaded.update(loaded)
                    else:
                        self.unconsumed[name] = "load_weights loaded nothing for it"
        for name in tensors:  # in the file but not announced
            self.unconsumed[name] = f"in {info.file} but not announced"

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        assert self.init_info is not None
        params = {name for name, _ in self.model.named_parameters()}
        report = {"sync": self.sync, "received": self.received, "unconsumed": self.unconsumed,
                  "missing": sorted(params - self.loaded), "pid": os.getpid()}
        if self.unconsumed:
            from vllm.logger import init_logger

            init_logger(__name__).error("vlrft_shm: %d tensor(s) not consumed: %s", len(self.unconsumed),
                                        list(self.unconsumed)[:5])
        name = f"report-{self.init_info.server}-{self.sync}-{os.getpid()}.json"
        tmp = os.path.join(self.init_info.folder, "." + name)
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, os.path.join(self.init_info.folder, name))  # readers never see half a report
        self._reset()

    def shutdown(self) -> None:
        self.init_info = None


def __getattr__(name: str):
    """`ShmWeightTransferEngine`, built on first access: vLLM is imported only inside vLLM's own processes."""
    if name != "ShmWeightTransferEngine":
        raise AttributeError(name)
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    engine = types.new_class(name, (ShmEngineMethods, WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]),
                             exec_body=lambda namespace: namespace.update(__module__=__name__))
    globals()[name] = engine
    return engine

"""Weight sync into running vLLM servers through vLLM's native weight-transfer API, with vlrft's own backends.

Two halves, one protocol:

* The engines of `vlrft.rollout.weight_transfer_worker` run inside every vLLM worker. vLLM creates one when the
  server is started with `--weight-transfer-config '{"backend": "vlrft_shm"}'` (or "vlrft_gloo"); `register()`
  (called by our `vllm.general_plugins` entry point, `vlrft.rollout.vllm_plugin`) puts them in vLLM's engine registry
  in every vLLM process. Each
  `/update_weights` brings one bucket of checkpoint-named tensors, which the engine loads through the model's own
  `load_weights` inside vLLM's checkpoint-format layerwise reload (opened at `/start_weight_update`, closed at
  `/finish_weight_update`), so each layer's post-load processing (the CPU backend's oneDNN packing, quantisation)
  runs on the new weights.
* `ServerWeightSync` runs in the trainer: it drives the four phases (start / update per bucket / finish / version)
  on one or more servers, between `/pause` and `/resume`, and checks every worker's report. How a bucket and a
  report travel is its transport's business (`stage` a bucket, `send` it, `discard` one never sent, `finish`):
  `ShmTransport` ("vlrft_shm": safetensors files in /dev/shm, servers on the trainer's host) or
  `weight_transfer_gloo.GlooTransport` ("vlrft_gloo": a broadcast over a gloo group, servers on any node).

Accounting (`vlrft.rollout.load_accounting`, the rule the colocated vLLM engine follows too): a tensor counts as
consumed when the model's `load_weights` returns a parameter for it; names vLLM's loaders drop silently (a bias the
model has no parameter for, a tied `lm_head`) or refuse (no such parameter) are unconsumed. The worker never raises
on that (a raise mid update would leave layers half loaded on the meta device): it sends a report at finish (by its
transport), after vLLM has finalised the reload, and the trainer fails naming the first unconsumed tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrft.rollout.load_accounting import WeightSyncError, unconsumed_line

BACKEND = "vlrft_shm"
PAUSE_MODE = "wait"  # see ServerWeightSync


# ============================================================================================ worker side (vLLM)


BACKENDS = {"vlrft_shm": "ShmWeightTransferEngine", "vlrft_gloo": "GlooWeightTransferEngine"}


def register() -> None:
    """Add our engines to vLLM's registry (called by `vlrft.rollout.vllm_plugin`; vLLM loads plugins in every process,
    possibly more than once in one, and the registry refuses a second registration)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for backend, engine in BACKENDS.items():
        if backend not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(backend, "vlrft.rollout.weight_transfer_worker", engine)


# ============================================================================================ trainer side


@dataclass
class Staged:
    """One bucket the trainer's side made ready to send (a transport's `stage`); `payload`: the transport's own."""

    names: list[str]
    info: dict
    nbytes: int
    payload: Any = None


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    missing: list[str] = field(default_factory=list)  # vLLM parameters no tensor of this sync loaded
    checked_alone: int = 0  # tensors the busiest worker offered its model one at a time (new to its engine)
    paused_seconds: float = 0.0  # from /pause to /resume: the part of `seconds` no generation overlaps

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class ServerWeightSync:
    """Pushes the policy's weights into running vLLM servers started with the transport's backend ("vlrft_shm" on
    this host by default; `transport=GlooTransport()` for "vlrft_gloo", servers on any node).

        sync = ServerWeightSync(["http://127.0.0.1:8000"])   # checks every server, then /init_weight_transfer_engine
        sync.sync(policy_weights.buckets(bucket_bytes, "cpu"), version="step-12")  # pause ... resume
        sync.close()

    Per sync, on every server: `/pause?mode=wait`, `/start_weight_update`, `/update_weights` per bucket (shm: one
    safetensors file in `folder`, written once and read by all servers; gloo: one broadcast of a packed buffer; either
    staged by the trainer before it is asked for, the first bucket before the pause), `/finish_weight_update`,
    `/update_weight_version` (read back from `/weight_info`), `/reset_prefix_cache` and `/reset_encoder_cache` (the KV
    and vision outputs computed by the old weights), `/resume`. vLLM's multimodal processor cache is kept: it holds
    inputs processed for the model (pixels, grids), which no weight changes, so images seen before are not processed
    again.

    Pause mode "wait": requests vLLM's scheduler runs finish on the weights they started with, so every sample's
    tokens come from one policy version; requests still queued run after the resume, on the new weights (the
    `ServerEngine` therefore syncs only once its own requests are answered). "abort" would discard work
    the caller then sees as aborted; "keep" freezes them and continues them on the new weights, mixing two policies
    (and stale KV) within one sample.

    A sync fails (`WeightSyncError`, one line) if any server fails any phase or any worker leaves a tensor
    unconsumed; the servers are then left paused, none reports the new version. `require_complete`: fail too
    if a vLLM parameter received nothing (a partial sync).
    """

    def __init__(self, urls: str | Iterable[str], folder: str | None = None, timeout: float = 600.0,
                 connect_timeout: float = 3.0, pause_mode: str = PAUSE_MODE, require_complete: bool = True,
                 transport=None):
        from vlrft.errors import require

        requests = require("requests", "driving vLLM servers (ServerWeightSync)")
        self.urls = [urls.rstrip("/")] if isinstance(urls, str) else [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("ServerWeightSync: no server URLs")
        self.http = requests.Session()
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.pause_mode, self.require_complete = pause_mode, require_complete
        self.count = 0
        self.transport = transport or ShmTransport(folder)
        self.workers = [self._call(u, "GET", "/get_world_size", short=True)["world_size"] for u in self.urls]
        self.transport.open(self)  # /init_weight_transfer_engine on every server

    @property
    def folder(self) -> str | None:
        """vlrft_shm: the folder of this driver's buckets and reports."""
        return getattr(self.transport, "folder", None)

    # ------------------------------------------------------------------------------------------- HTTP
    def _call(self, url: str, method: str, path: str, json_body: Any = None, params: dict | None = None,
              short: bool = False) -> Any:
        import requests

        try:
            response = self.http.request(method, url + path, json=json_body, params=params,
                                         timeout=(self.connect_timeout, self.connect_timeout if short else
                                                  self.timeout))
        except requests.RequestException as err:
            raise WeightSyncError(f"vLLM server {url} unreachable ({path}): {type(err).__name__}") from None
        if response.status_code != 200:
            raise WeightSyncError(f"vLLM server {url}{path} answered {response.status_code}: "
                                  f"{' '.join(response.text.split())[:300]}")
        return response.json() if response.content else None

    def _all(self, method: str, path: str, body=None, params: dict | None = None) -> list[Any]:
        """The same call on every server at once; fails (after all have answered) if any failed."""
        with ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self._call, url, method, path, body(i) if callable(body) else body, params)
                       for i, url in enumerate(self.urls)]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise WeightSyncError(f"{failed[0]}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        return [f.result() for f in futures]

    # ------------------------------------------------------------------------------------------- phases
    def pause(self) -> None:
        # not vLLM 0.32's deprecated clearing of every cache at the pause: `sync` resets what the weights computed
        self._all("POST", "/pause", params={"mode": self.pause_mode, "clear_cache": "false"})

    def resume(self) -> None:
        self._all("POST", "/resume")

    def versions(self) -> list[str]:
        return [r["weight_version"] for r in self._all("GET", "/weight_info")]

    def sync(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: str,
             before_pause: Callable[[], None] | None = None) -> SyncStats:
        """One full sync of `buckets` (lists of (checkpoint name, tensor)); `version` is set on every server.

        The trainer's side of a bucket (reading it, a CPU copy, its shm file or packed buffer: the transport's
        `stage`) runs while the servers still generate for the first bucket, and while they load the previous one
        for the others; the servers pause only for the loads (`SyncStats.paused_seconds`). At most two buckets are
        staged at once. `before_pause` runs between the first bucket's staging and the pause (the `ServerEngine`
        waits there for its requests out)."""
        start = time.perf_counter()
        self.count += 1
        staged = self._staged(buckets)
        first = next(staged, None)  # before the pause: generation goes on meanwhile
        if first is None:
            raise WeightSyncError("a sync with no buckets")
        try:
            if before_pause is not None:
                before_pause()
            paused = time.perf_counter()
            self.pause()
        except BaseException:
            staged.close()
            raise
        nbytes = tensors = count = 0
        with ThreadPoolExecutor(1, thread_name_prefix="vlrft-sync") as loader:
            loading = None
            try:
                self._all("POST", "/start_weight_update")
                for item in itertools.chain([first], staged):  # the next bucket is staged while this one loads
                    if loading is not None:
                        loading.result()
                    loading = loader.submit(self.transport.send, self, item)
                    nbytes, tensors, count = nbytes + item.nbytes, tensors + len(item.names), count + 1
                loading.result()
            except BaseException:
                if loading is not None:
                    wait([loading])
                staged.close()
                try:  # close the update where it was opened: vLLM finalises the reload (layers that got nothing
                    self.transport.finish(self)  # keep their weights), so a retry can start a new one
                except WeightSyncError:
                    pass
                raise
        reports = self.transport.finish(self)
        missing = self._check_reports(reports, tensors)
        self._all("POST", "/update_weight_version", {"new_version": version})
        # Three independent calls at once (each a round trip while the servers stay paused):
        with ThreadPoolExecutor(3, thread_name_prefix="vlrft-sync") as pool:
            versions = pool.submit(self.versions)
            resets = pool.submit(self._all, "POST", "/reset_prefix_cache")
            encoder = pool.submit(self._all, "POST", "/reset_encoder_cache")
        if set(versions.result()) != {version}:
            raise WeightSyncError(f"servers report versions {versions.result()} after setting {version!r}")
        for url, result in zip(self.urls, resets.result()):
            if not result.get("success"):
                raise WeightSyncError(f"vLLM server {url} refused to reset its prefix cache (requests running?)")
        encoder.result()
        self.resume()
        end = time.perf_counter()
        checked_alone = max(r.get("checked_alone", 0) for workers in reports for r in workers)
        return SyncStats(end - start, nbytes, tensors, count, missing, checked_alone, paused_seconds=end - paused)

    def _staged(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[Staged]:
        """Each bucket checked, copied to the CPU and staged by the transport (in the caller's thread: reading a
        sharded policy's bucket is collective); a staged bucket never sent is discarded."""
        for count, bucket in enumerate(buckets):
            names = [n for n, _ in bucket]
            if len(set(names)) != len(names):
                raise WeightSyncError(f"bucket {count} names a tensor twice")
            contiguous = [t.detach().to("cpu").contiguous() for _, t in bucket]
            info = {"sync": self.count, "bucket": count, "names": names,
                    "dtype_names": [str(t.dtype).removeprefix("torch.") for t in contiguous],
                    "shapes": [list(t.shape) for t in contiguous]}
            del bucket
            item = self.transport.stage(self, names, contiguous, info)
            del contiguous
            try:
                yield item
            except GeneratorExit:
                self.transport.discard(item)
                raise

    def _check_reports(self, reports: list[list[dict]], sent: int) -> list[str]:
        """Every worker of every server reported this sync (`reports`: per server), with every tensor consumed."""
        missing: set[str] = set()
        for url, workers, reported in zip(self.urls, self.workers, reports):
            if len(reported) != workers:
                raise WeightSyncError(f"vLLM server {url}: {len(reported)} of its {workers} workers reported sync "
                                      f"{self.count} (is it running the {self.transport.backend} backend"
                                      f"{self.transport.where}?)")
            for report in reported:
                if report["unconsumed"]:
                    raise WeightSyncError(unconsumed_line(f"vLLM server {url}", report["unconsumed"], sent) +
                                          " (servers left paused)")
                if report["received"] != sent:
                    raise WeightSyncError(f"vLLM server {url}: a worker received {report['received']} of the "
                                          f"{sent} tensors sent")
                missing |= set(report["missing"])
        if missing and self.require_complete:
            raise WeightSyncError(f"{len(missing)} vLLM parameters got no tensor in this sync: "
                                  f"{sorted(missing)[:3]} (servers left paused)")
        return sorted(missing)

    def close(self) -> None:
        """Release the servers' transfer engines (they keep serving) and the transport's resources."""
        try:
            self._all("POST", "/shutdown_weight_transfer_engine")
        finally:
            self.transport.close()


class ShmTransport:
    """"vlrft_shm": each bucket a safetensors file in a folder of this host (/dev/shm by default) that every server
    reads; the workers' reports are files there too. The servers must run on this host, as this user (mkdtemp's
    0700)."""

    backend = BACKEND
    where = " on this host"

    def __init__(self, folder: str | None = None):
        self.base = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.folder: str | None = None

    def open(self, sync: ServerWeightSync) -> None:
        self.folder = tempfile.mkdtemp(prefix="vlrft-xfer-", dir=self.base)
        try:
            sync._all("POST", "/init_weight_transfer_engine",
                      lambda i: {"init_info": {"folder": self.folder, "server": f"s{i}"}})
        except BaseException:
            self.close()
            raise

    def stage(self, sync: ServerWeightSync, names: list[str], tensors: list[torch.Tensor], info: dict) -> Staged:
        """The bucket's safetensors file, written before the servers are asked to read it."""
        from safetensors.torch import save_file

        assert self.folder is not None
        info["file"] = f"b{sync.count}-{info.pop('bucket')}-{uuid.uuid4().hex[:8]}.safetensors"
        save_file(dict(zip(names, tensors)), os.path.join(self.folder, info["file"]))
        return Staged(names, info, sum(t.numel() * t.element_size() for t in tensors))

    def send(self, sync: ServerWeightSync, staged: Staged) -> None:
        try:
            sync._all("POST", "/update_weights", {"update_info": staged.info})
        finally:
            self.discard(staged)

    def discard(self, staged: Staged) -> None:
        assert self.folder is not None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.folder, staged.info["file"]))

    def finish(self, sync: ServerWeightSync) -> list[list[dict]]:
        """`/finish_weight_update` on every server, then each server's reports of this sync (read and removed)."""
        sync._all("POST", "/finish_weight_update")
        assert self.folder is not None
        reports = []
        for i in range(len(sync.urls)):
            prefix = f"report-s{i}-{sync.count}-"
            reports.append([])
            for file in sorted(f for f in os.listdir(self.folder) if f.startswith(prefix)):
                path = os.path.join(self.folder, file)
                with open(path) as f:
                    reports[-1].append(json.load(f))
                os.unlink(path)
        return reports

    def close(self) -> None:
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def transport_for(kind: str, master_address: str | None = None, master_port: int = 0):
    """The trainer's half of a `rollout.weight_transfer` kind: "shm" (same host) or "gloo" (any node)."""
    if kind == "shm":
        return ShmTransport()
    if kind == "gloo":
        from vlrft.rollout.weight_transfer_gloo import GlooTransport

        return GlooTransport(master_address, master_port)
    raise ValueError(f"rollout.weight_transfer={kind!r}: 'shm' (servers on the trainer's host) or 'gloo' (any node)")

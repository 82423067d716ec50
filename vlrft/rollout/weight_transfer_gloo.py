"""The "vlrft_gloo" weight-transfer backend: weights to vLLM servers on any node, over a torch.distributed gloo group.

The trainer's sending rank is rank 0 of a gloo group over TCP; every worker of every server joins it at
`/init_weight_transfer_engine`, whose init info carries what vLLM's own NCCL backend's does (master address and port,
world size, the server's rank offset; plus the group's timeout). A worker's rank is its offset plus its index in its
server (data-parallel index x (TP x PP) + rank, as vLLM's NCCL backend numbers them).

Per bucket, `/update_weights` announces the tensors (names, dtype names, shapes, as vLLM's NCCL backend; plus the
packed size) and the trainer broadcasts them as one packed byte buffer while the workers are inside that call. At
`/finish_weight_update` every worker sends its accounting report (`vlrft.rollout.weight_transfer`, "Accounting") to
rank 0 over the same group: the report needs no shared filesystem and no route of its own (vLLM's HTTP routes return
no worker results), and it travels on the channel the weights came by.

Both halves use this module (torch only; nothing of vLLM): `open_group`, `bucket_layout`, `pack`, `unpack`,
`send_report` / `recv_report` on the wire, and `GlooTransport`, the trainer's half under `ServerWeightSync`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any
from urllib.parse import urlparse

import torch

from vlrft.rollout.weight_transfer import Staged

BACKEND = "vlrft_gloo"
ALIGN = 64  # bytes: every tensor of a packed bucket starts at a multiple (any dtype's view of the buffer is aligned)
STORE_PREFIX = "vlrft_gloo"


# ============================================================================================ the wire (both sides)


def local_address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent): the address its peers can reach it at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def joined_key(rank: int) -> str:
    return f"{STORE_PREFIX}/joined/{rank}"


def open_group(store: Any, address: str, rank: int, world_size: int, timeout_s: float):
    """This process's member of the gloo group (its own process group: the default one is left alone). Its device
    binds `address`, or the interface named by GLOO_SOCKET_IFNAME (torch's own variable) where that is set. `store`:
    a TCPStore connection no other thread uses meanwhile (its client holds a lock while it waits for a key)."""
    import torch.distributed as dist

    store.set(joined_key(rank), "1")  # the trainer names the servers whose workers never came
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface else
                        dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, options)


def connect_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(master_address, master_port, world_size, False, datetime.timedelta(seconds=timeout_s))


def bucket_layout(dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """(each tensor's byte offset in the packed buffer, the buffer's size): the same on both sides."""
    offsets, end = [], 0
    for dtype_name, shape in zip(dtype_names, shapes):
        offsets.append(-(-end // ALIGN) * ALIGN)
        numel = 1
        for size in shape:
            numel *= int(size)
        end = offsets[-1] + numel * getattr(torch, dtype_name).itemsize
    return offsets, end


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding `tensors` at `bucket_layout`'s offsets."""
    offsets, nbytes = bucket_layout([dtype_name(t) for t in tensors], [t.shape for t in tensors])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for offset, tensor in zip(offsets, tensors):
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        buffer[offset:offset + data.numel()].copy_(data)
    return buffer


def unpack(buffer: torch.Tensor, dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The tensors `pack` put in `buffer`, as views of it (the buffer is never reused: a load may keep them)."""
    offsets, _ = bucket_layout(dtype_names, shapes)
    tensors = []
    for offset, name, shape in zip(offsets, dtype_names, shapes):
        dtype = getattr(torch, name)
        numel = 1
        for size in shape:
            numel *= int(size)
        tensors.append(buffer[offset:offset + numel * dtype.itemsize].view(dtype).view(list(shape)))
    return tensors


def broadcast(group, buffer: torch.Tensor) -> None:
    """Rank 0's `buffer` into every member's (same size); returns once this member's part is done."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def send_report(group, report: dict) -> None:
    """This worker's report to rank 0: its length, then its JSON bytes."""
    data = torch.frombuffer(bytearray(json.dumps(report).encode()), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], 0, 0).wait()
    group.send([data], 0, 0).wait()


def recv_report(group, rank: int) -> dict:
    length = torch.zeros(1, dtype=torch.int64)
    group.recv([length], rank, 0).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    group.recv([data], rank, 0).wait()
    return json.loads(bytes(data.numpy()).decode())


# ============================================================================================ trainer side


def in_thread(call: Callable[[], Any]) -> Future:
    """`call` on a daemon thread: a peer that never answers cannot keep the trainer from exiting."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name="vlrft-gloo").start()
    return future


class GlooTransport:
    """The trainer's half of "vlrft_gloo" (see the module docstring), driven by `ServerWeightSync`.

    `master_address`: this host's address as the servers reach it (default: its address on the route to the first
    server); `master_port`: the rendezvous port (0: a free one); `join_timeout`: seconds the servers' workers get to
    join the group once their servers acknowledged `/init_weight_transfer_engine`.

    Every collective runs beside the HTTP calls that make the workers join it; the first failure of either is raised
    at once. A failure inside the group (a server that failed mid-broadcast) leaves it unusable: later syncs fail
    naming it, and a new `ServerWeightSync` makes the servers join a new one.
    """

    backend = BACKEND
    where = ""

    def __init__(self, master_address: str | None = None, master_port: int = 0, join_timeout: float = 60.0):
        self.master_address, self.master_port, self.join_timeout = master_address, master_port, join_timeout
        self.store = self.group = None
        self.ranks: list[range] = []  # each server's workers' ranks
        self.broken: str | None = None

    def open(self, sync) -> None:
        import torch.distributed as dist

        address = self.master_address or local_address_towards(urlparse(sync.urls[0]).hostname or "127.0.0.1")
        world_size = 1 + sum(sync.workers)
        starts = [1 + sum(sync.workers[:i]) for i in range(len(sync.urls))]
        self.ranks = [range(start, start + n) for start, n in zip(starts, sync.workers)]
        self.store = dist.TCPStore(address, self.master_port, world_size, True,
                                   datetime.timedelta(seconds=sync.timeout), wait_for_workers=False)
        # the group gets a store connection of its own: a TCPStore client blocks in a wait with its lock held, so
        # the checks below (on the master's connection) would wait for the group's rendezvous
        group = in_thread(lambda: open_group(connect_store(address, self.store.port, world_size, sync.timeout),
                                             address, 0, world_size, sync.timeout))
        deadline = time.monotonic() + self.join_timeout

        def check_joined() -> None:
            absent = [url for url, ranks in zip(sync.urls, self.ranks)
                      if not all(self.store.check([joined_key(r)]) for r in ranks)]
            if absent and time.monotonic() > deadline:
                from vlrft.rollout.load_accounting import WeightSyncError

                self.broken = "its workers never joined"
                raise WeightSyncError(f"vLLM server {absent[0]}: its workers did not join the gloo group within "
                                      f"{self.join_timeout:g} s of /init_weight_transfer_engine (is it running the "
                                      f"{BACKEND} backend, and can it reach {address}:{self.store.port}?)")

        self.group = self._settle([self._post(sync, i, "/init_weight_transfer_engine", {"init_info": {
            "master_address": address, "master_port": self.store.port, "rank_offset": starts[i],
            "world_size": world_size, "timeout_s": sync.timeout}}) for i in range(len(sync.urls))], group,
            check_joined)

    def _post(self, sync, server: int, path: str, body: Any) -> Future:
        return in_thread(lambda: sync._call(sync.urls[server], "POST", path, body))

    def _settle(self, remote: list[Future], local: Future, check: Callable[[], None] | None = None) -> Any:
        """`local`'s result (this side's part of a collective) once it and every `remote` call (the HTTP calls that
        make the workers take part) are done; the first failure of any is raised as soon as it happens, leaving the
        group unusable if anything is still in flight. `check`: called every second meanwhile (it may raise)."""
        pending = {*remote, local}
        while pending:
            done, pending = wait(pending, timeout=1.0 if check else None, return_when=FIRST_COMPLETED)
            self._raise_failure(done, pending)
            if check and pending:
                try:
                    check()
                except BaseException:
                    self.broken = self.broken or "a check failed mid-transfer"
                    raise
        return local.result()

    def _raise_failure(self, done: set[Future], pending: set[Future]) -> None:
        """The first failure among `done`, one line: a server's (it names the server) before this side's."""
        from vlrft.rollout.load_accounting import WeightSyncError

        failed = sorted((f.exception() for f in done if f.exception() is not None),
                        key=lambda err: not isinstance(err, WeightSyncError))
        if failed:
            if pending:
                self.broken = f"a sync failed mid-transfer: {failed[0]}"
            if isinstance(failed[0], WeightSyncError):
                raise failed[0]
            lines = str(failed[0]).strip().splitlines() or [""]
            raise WeightSyncError(f"the {BACKEND} group failed on the trainer's side: {type(failed[0]).__name__}: "
                                  f"{lines[0][:300]}") from failed[0]

    def _usable(self) -> None:
        if self.group is None or self.broken:
            from vlrft.rollout.load_accounting import WeightSyncError

            raise WeightSyncError(f"the {BACKEND} group is unusable ({self.broken or 'closed'}); create a new "
                                  "ServerWeightSync (the servers join a new group)")

    def stage(self, sync, names: list[str], tensors: list[torch.Tensor], info: dict) -> Staged:
        """The bucket packed into one buffer (broadcast at `send`)."""
        buffer = pack(tensors)
        info["nbytes"] = buffer.numel()
        return Staged(names, info, sum(t.numel() * t.element_size() for t in tensors), buffer)

    def send(self, sync, staged: Staged) -> None:
        self._usable()
        buffer, staged.payload = staged.payload, None  # freed once sent (`sync` keeps the first bucket's `Staged`)
        self._settle([self._post(sync, i, "/update_weights", {"update_info": staged.info})
                      for i in range(len(sync.urls))], in_thread(lambda: broadcast(self.group, buffer)))

    def discard(self, staged: Staged) -> None:
        staged.payload = None

    def finish(self, sync) -> list[list[dict]]:
        """`/finish_weight_update` on every server, receiving every worker's report meanwhile."""
        self._usable()
        reports = in_thread(lambda: [[recv_report(self.group, r) for r in ranks] for ranks in self.ranks])
        return self._settle([self._post(sync, i, "/finish_weight_update", None) for i in range(len(sync.urls))],
                            reports)

    def close(self) -> None:
        self.group = self.store = None

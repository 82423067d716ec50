"""The "vlrft_gloo" weight transfer without vLLM: the wire (packing, the gloo group, reports) and the trainer's half
(`GlooTransport` under `ServerWeightSync`).

The servers here are stand-ins: HTTP servers in this process whose "workers" (threads) join the real gloo group with
the wire helpers the vLLM-side engine uses, receive the real broadcasts and send reports back over the group, but load
into a dict instead of a model (vLLM cannot run here). tests/test_vllm_server_gloo.py runs the same driver against a
real vLLM server. Expected values are the tensors the test sent, compared bit for bit.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import torch

pytest.importorskip("requests")

from _stand_ins import AcknowledgeAll  # noqa: E402
from vlrft.rollout import weight_transfer_gloo as wire  # noqa: E402
from vlrft.rollout.weight_transfer import ServerWeightSync, WeightSyncError  # noqa: E402
from vlrft.rollout.weight_transfer_gloo import GlooTransport  # noqa: E402

TENSORS = {
    "a.bf16": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).bfloat16(),
    "b.f32": torch.randn(7, generator=torch.Generator().manual_seed(1)),
    "c.scalar": torch.tensor(2.5, dtype=torch.float64),
    "d.int": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "e.empty": torch.zeros(0, 4),
    "f.bool": torch.tensor([True, False, True]),
    "g.transposed": torch.arange(12, dtype=torch.float16).reshape(3, 4).t(),  # not contiguous
}


def test_a_packed_bucket_unpacks_to_the_same_tensors_at_aligned_offsets():
    tensors = list(TENSORS.values())
    buffer = wire.pack(tensors)
    names = [wire.dtype_name(t) for t in tensors]
    offsets, nbytes = wire.bucket_layout(names, [t.shape for t in tensors])
    assert buffer.dtype == torch.uint8 and buffer.numel() == nbytes and all(o % wire.ALIGN == 0 for o in offsets)
    for sent, got in zip(tensors, wire.unpack(buffer, names, [list(t.shape) for t in tensors])):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


class FakeServer:
    """A stand-in vLLM server with `workers` gloo workers: each loads the names in `accepts` into `loaded` and
    reports the rest unconsumed, as the vLLM-side engine does."""

    def __init__(self, workers: int, accepts: set[str]):
        self.workers, self.accepts = workers, accepts
        self.refuse_updates = False  # answer /update_weights with an error, without taking part in the broadcast
        self.groups: list = []
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.unconsumed: list[dict[str, str]] = [{} for _ in range(workers)]
        self.received = [0] * workers
        self.errors: list[Exception] = []
        self.version = "0"
        handler = type("Handler", (FakeHandler,), {"fake": self})
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def each_worker(self, call) -> None:
        def guarded(w):  # a worker left waiting in an abandoned group fails at its timeout, after its test
            try:
                call(w)
            except RuntimeError as err:
                self.errors.append(err)
        threads = [threading.Thread(target=guarded, args=(w,), daemon=True) for w in range(self.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def route(self, path: str, body: dict):
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            self.groups = [None] * self.workers

            def join(w):  # each worker its own store connection, as each vLLM worker (a process of its own)
                store = wire.connect_store(info["master_address"], info["master_port"], info["world_size"], 30)
                self.groups[w] = wire.open_group(store, "127.0.0.1", info["rank_offset"] + w, info["world_size"], 30)
            self.each_worker(join)
        elif path == "/update_weights":
            if self.refuse_updates:
                return None
            info = body["update_info"]
            assert wire.bucket_layout(info["dtype_names"], info["shapes"])[1] == info["nbytes"]

            def receive(w):
                buffer = torch.empty(info["nbytes"], dtype=torch.uint8)
                wire.broadcast(self.groups[w], buffer)
                self.received[w] += len(info["names"])
                for name, tensor in zip(info["names"], wire.unpack(buffer, info["dtype_names"], info["shapes"])):
                    if name in self.accepts:
                        self.loaded[w][name] = tensor
                    else:
                        self.unconsumed[w][name] = "no such parameter"
            self.each_worker(receive)
        elif path == "/finish_weight_update":
            def report(w):
                wire.send_report(self.groups[w], {"received": self.received[w], "unconsumed": self.unconsumed[w],
                                                  "missing": []})
                self.received[w], self.unconsumed[w] = 0, {}
            self.each_worker(report)
        elif path == "/update_weight_version":
            self.version = body["new_version"]
        return {"success": True}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


class FakeHandler(AcknowledgeAll):
    fake: FakeServer

    def do_GET(self):
        self._answer({"world_size": self.fake.workers} if self.path.startswith("/get_world_size") else
                     {"weight_version": self.fake.version})

    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer = self.fake.route(self.path.split("?")[0], json.loads(data) if data.strip() else {})
        if answer is None:
            self.send_response(500)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"refused")
        else:
            self._answer(answer)


@pytest.fixture
def servers():
    fakes = [FakeServer(2, set(TENSORS)), FakeServer(1, set(TENSORS))]
    yield fakes
    for fake in fakes:
        fake.close()


def buckets(*extra):
    items = list(TENSORS.items())
    return [items[:3], items[3:], *extra]


def test_every_worker_of_every_server_receives_every_tensor(servers):
    sync = ServerWeightSync([s.url for s in servers], timeout=30, transport=GlooTransport())
    stats = sync.sync(buckets(), version="step-1")
    for server in servers:
        for loaded in server.loaded:
            assert list(loaded) == list(TENSORS)
            assert all(torch.equal(loaded[n], t) and loaded[n].dtype == t.dtype for n, t in TENSORS.items())
    assert sync.versions() == ["step-1", "step-1"]
    assert (stats.tensors, stats.buckets) == (len(TENSORS), 2)
    # the group carries on: a second sync over it
    sync.sync(buckets(), version="step-2")
    assert sync.versions() == ["step-2", "step-2"]
    sync.close()


def test_a_tensor_a_worker_did_not_consume_fails_the_sync_naming_it(servers):
    sync = ServerWeightSync([s.url for s in servers], timeout=30, transport=GlooTransport())
    with pytest.raises(WeightSyncError) as failure:
        sync.sync(buckets([("model.bogus.weight", torch.ones(2))]), version="never")
    message = str(failure.value)
    assert message.startswith(f"vLLM server {servers[0].url} did not consume 1 of 8 tensors: model.bogus.weight "
                              "(no such parameter)") and "\n" not in message, message
    assert sync.versions() == ["0", "0"]
    sync.sync(buckets(), version="step-1")  # the reports came back over the group: it is still in step
    assert sync.versions() == ["step-1", "step-1"]


def test_a_server_failing_mid_transfer_fails_the_sync_at_once_and_the_group_is_then_refused(servers):
    sync = ServerWeightSync([s.url for s in servers], timeout=30, transport=GlooTransport())
    servers[1].refuse_updates = True  # the other server's workers wait in the broadcast, as the trainer does
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"^vLLM server {servers[1].url}/update_weights answered 500: refused$"):
        sync.sync(buckets(), version="never")
    assert time.monotonic() - started < 10  # not the group's 30 s timeout
    with pytest.raises(WeightSyncError, match="^the vlrft_gloo group is unusable \\(a sync failed mid-transfer: "
                                              ".*\\); create a new ServerWeightSync"):
        sync.sync(buckets(), version="never")


def test_a_server_whose_workers_never_join_is_named_in_one_line(servers):
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AcknowledgeAll)  # acknowledges, joins nothing
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    stub_url = f"http://127.0.0.1:{stub.server_address[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as failure:
            ServerWeightSync([servers[0].url, stub_url], timeout=30, transport=GlooTransport(join_timeout=2))
    finally:
        stub.shutdown()
        stub.server_close()
    message = str(failure.value)
    assert message.startswith(f"vLLM server {stub_url}: its workers did not join the gloo group within 2 s of "
                              "/init_weight_transfer_engine (is it running the vlrft_gloo backend") \
        and "\n" not in message, message
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_serve_command_prints_the_backend_of_each_weight_transfer(kind, capsys):
    import shlex

    from vlrft.cli import main
    from vlrft.rollout.weight_transfer import BACKENDS, transport_for

    assert main(["serve-command", "/models/m", "--host", "0.0.0.0", "--weight-transfer", kind]) == 0
    words = shlex.split(capsys.readouterr().out)
    backend = json.loads(words[words.index("--weight-transfer-config") + 1])["backend"]
    # the backend vLLM is told to use is one vlrft registers, and the one the trainer's transport drives
    assert backend == f"vlrft_{kind}" == transport_for(kind).backend and backend in BACKENDS

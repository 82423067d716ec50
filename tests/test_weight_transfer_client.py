"""The trainer side of the server weight sync (`ServerWeightSync`) without vLLM: its failures are one line naming the
server. The server here is a stub HTTP server (a mock of vLLM's RL routes, which cannot run without vLLM) that
acknowledges every call and loads nothing; tests/test_vllm_server.py runs the same driver against a real vLLM.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("requests")

from _stand_ins import AcknowledgeAll  # noqa: E402
from vlrft.rollout.weight_transfer import ServerWeightSync, WeightSyncError  # noqa: E402


@pytest.fixture
def stub():
    AcknowledgeAll.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AcknowledgeAll)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_server_is_one_line_naming_it(stub, tmp_path):
    dead = dead_url()
    with pytest.raises(WeightSyncError) as failure:
        ServerWeightSync([stub, dead], folder=str(tmp_path))
    assert str(failure.value) == f"vLLM server {dead} unreachable (/get_world_size): ConnectionError"
    assert os.listdir(tmp_path) == []  # no bucket folder left behind


def test_a_server_that_loads_nothing_fails_the_sync(stub, tmp_path):
    sync = ServerWeightSync(stub, folder=str(tmp_path))
    with pytest.raises(WeightSyncError, match=f"^vLLM server {stub}: 0 of its 1 workers reported sync 1 "):
        sync.sync([[("model.norm.weight", torch.ones(4))]], version="new")
    posts = [c for c in AcknowledgeAll.calls if c.startswith("POST")]
    # the four phases ran, between a pause and no resume: the failed sync sets no version and leaves it paused
    assert posts == ["POST /init_weight_transfer_engine", "POST /pause?mode=wait&clear_cache=false",
                     "POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update"]
    assert os.listdir(sync.folder) == []  # the bucket file was removed once the server had answered
    sync.close()
    assert not os.path.exists(sync.folder)


def test_a_bucket_naming_a_tensor_twice_is_refused(stub, tmp_path):
    sync = ServerWeightSync(stub, folder=str(tmp_path))
    with pytest.raises(WeightSyncError, match="names a tensor twice"):
        sync.sync([[("a", torch.ones(1)), ("a", torch.ones(1))]], version="new")
    assert AcknowledgeAll.calls == ["GET /get_world_size", "POST /init_weight_transfer_engine"]  # never paused
    sync.close()


def test_a_bucket_failing_mid_sync_closes_the_update_and_leaves_no_file(stub, tmp_path):
    def buckets():
        yield [("a", torch.ones(1))]
        raise RuntimeError("gathering the second bucket failed")

    sync = ServerWeightSync(stub, folder=str(tmp_path))
    with pytest.raises(RuntimeError, match="second bucket"):
        sync.sync(buckets(), version="new")
    assert AcknowledgeAll.calls[-1] == "POST /finish_weight_update"  # the update it opened is closed
    assert os.listdir(sync.folder) == []
    sync.close()


class Loads(AcknowledgeAll):
    """Stand-in for a vLLM server running vlrft_shm that takes `delay` seconds to load a bucket and then reports every
    tensor consumed; logs the moments each load starts and ends in `events`."""

    events: list[str] = []
    delay = 0.3
    folder = ""
    received = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.calls.append("POST " + self.path)
        if self.path == "/init_weight_transfer_engine":
            type(self).folder = body["init_info"]["folder"]
        if self.path == "/update_weights":
            info = body["update_info"]
            self.events.append(f"load {info['bucket'] if 'bucket' in info else info['file'].split('-')[1]} starts")
            assert os.path.exists(os.path.join(self.folder, info["file"]))  # staged before it was asked for
            time.sleep(self.delay)
            type(self).received += len(info["names"])
            self.events.append("load ends")
        if self.path == "/finish_weight_update":
            report = {"unconsumed": {}, "received": self.received, "missing": [], "checked_alone": 0}
            with open(os.path.join(self.folder, f"report-s0-1-{os.getpid()}.json"), "w") as f:
                json.dump(report, f)
        self.events.append("POST " + self.path.split("?")[0])
        self._answer({"success": True})

    def do_GET(self):
        self.calls.append("GET " + self.path)
        self._answer({"world_size": 1} if self.path.startswith("/get_world_size") else {"weight_version": "new"})


def test_buckets_are_staged_before_the_pause_and_while_the_previous_one_loads(tmp_path):
    Loads.calls, Loads.events, Loads.received = [], [], 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loads)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    read = 0.3  # seconds the trainer takes to read each bucket (a gather, a device copy)

    def buckets():
        for i in range(3):
            time.sleep(read)
            Loads.events.append(f"read {i}")
            yield [(f"layer{i}.weight", torch.full((4,), float(i)))]

    try:
        sync = ServerWeightSync(f"http://127.0.0.1:{server.server_address[1]}", folder=str(tmp_path))
        Loads.events = []
        stats = sync.sync(buckets(), version="new")
        left = os.listdir(sync.folder)
        sync.close()
    finally:
        server.shutdown()
        server.server_close()
    events = [e for e in Loads.events if not e.startswith("POST /update_weights")]
    assert events[:4] == ["read 0", "POST /pause", "POST /start_weight_update", "load 0 starts"]
    # each later bucket is read while the one before it loads
    assert events[4:10] == ["read 1", "load ends", "load 1 starts", "read 2", "load ends", "load 2 starts"]
    assert (stats.tensors, stats.buckets, stats.bytes) == (3, 3, 48)
    # the servers were not paused while the first bucket was read, nor for the later reads (hidden by the loads)
    assert stats.paused_seconds < stats.seconds - read + 0.05
    assert stats.paused_seconds < 3 * Loads.delay + read
    assert left == []

"""The trainer side of the server weight sync (`ServerWeightSync`) without vLLM: its failures are one line naming the
server. The server here is a stub HTTP server (a mock of vLLM's RL routes, which cannot run without vLLM) that
acknowledges every call and loads nothing; tests/test_vllm_server.py runs the same driver against a real vLLM.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading

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
    assert AcknowledgeAll.calls[-1] == "POST /finish_weight_update"  # the update it opened is closed
    sync.close()

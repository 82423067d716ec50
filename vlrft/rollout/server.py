"""Rollout on vLLM's own server (`rollout.engine=vllm_server`, `rollout.server_urls=[...]`).

The servers are vLLM's OpenAI-compatible server, started with vLLM's own command line
(`vlrft serve-command` prints it; docs/engines.md "Rollout servers"). Each trainer rank sends its
prompts over HTTP; nothing of vLLM is imported in the training processes.

* One tokenization: a prompt goes to `/inference/v1/generate` (vLLM's tokens-in/tokens-out route,
  registered by `--enable-scale-out`) as our folded prompt ids plus the images our processor saw,
  as lossless PNG data URLs (`content_parts`). The server runs the same multimodal processor as the
  colocated engine (`vlrft.rollout.requests`), and returns the prompt ids it ran
  (`return_token_ids`): they must equal ours (`check_prompt`), or the step stops naming the sample.
  A video goes as the frames and metadata our processor sampled (`vlrft.rollout.video_frames`), which
  the server reads with vlrft's video loader, "vlrft_frames" (started with it: `vlrft serve-command`;
  checked at the first video through the server's `/server_info`).
* Sampling: the colocated engine's vLLM sampling options (`vllm_sampling_kwargs`), processed logprobs
  (the server is started with `--logprobs-mode processed_logprobs`), and a seed per request derived
  from (engine seed, call, rank, prompt): the same completions whichever server answers.
* Several servers: a group (one prompt, `n` completions) is one request, so its prompt is prefilled
  once on one server; each request goes to the server with the fewest outstanding requests. A server
  that stops answering is dropped and its requests go to the others; with none left, the step stops
  within `rollout.server_timeout_s`, naming the server.
* Weight versions: every completion carries the version of the weights that sampled it (the
  engine's `version` when it was sent): a sync starts only once the requests out are answered and
  holds new ones back until it ends (`update_weights`), then pauses the servers
  (`vlrft.rollout.weight_transfer.ServerWeightSync`).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlrft.errors import ConfigError, UserError
from vlrft.rollout.base import Rollouts, SamplingParams
from vlrft.rollout.outputs import EngineError, EngineSample, check_prompt, to_rollouts
from vlrft.rollout.requests import PromptRequest, image_wrappers, vllm_requests
from vlrft.rollout.video_frames import VIDEO_BACKEND, frames_data_url

if TYPE_CHECKING:
    from vlrft.data import PromptBatch
    from vlrft.tokens import TokenSpec

logger = logging.getLogger(__name__)
GENERATE_ROUTE = "/inference/v1/generate"


def serve_command(model: str, host: str = "127.0.0.1", port: int = 8000, python: str = "python", dtype: str = "bfloat16",
                  gpu_memory_utilization: float = 0.9, max_model_len: int | None = None, tensor_parallel_size: int = 1,
                  cpu: bool = False, weight_transfer: str = "shm") -> list[str]:
    """vLLM's own server command for a rollout server (run it with `VLLM_SERVER_DEV_MODE=1`, which serves the
    weight-sync routes). The flags that matter: `--enable-scale-out` (the tokens-in route), processed logprobs
    (those of the distribution sampled from, as TIS needs), our weight-transfer backend for `weight_transfer`
    (rollout.weight_transfer: "shm" -> vlrft_shm, "gloo" -> vlrft_gloo; `vlrft.rollout.weight_transfer`, loaded by
    vLLM through vlrft's plugin, `vlrft.rollout.vllm_plugin`), prefix caching (a group's n completions share one
    prefill), vlrft's video loader (the frames and metadata our processor sampled, `vlrft.rollout.video_frames`).
    On CPUs: eager mode (compiling costs minutes and buys nothing) and whole prefills (vLLM-CPU cannot rewind a
    seeded request's generator after a chunked prefill step)."""
    import json

    if weight_transfer not in ("shm", "gloo"):
        raise ConfigError(f"weight transfer {weight_transfer!r}: 'shm' (servers on the trainer's host) or 'gloo' "
                          "(servers on any node)")
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
               "--port", str(port), "--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory_utilization),
               "--tensor-parallel-size", str(tensor_parallel_size), "--enable-scale-out",
               "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
               "--weight-transfer-config", json.dumps({"backend": f"vlrft_{weight_transfer}"}),
               "--media-io-kwargs", json.dumps({"video": {"video_backend": VIDEO_BACKEND}})]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if cpu:  # as the colocated engine on a CPU (vlrft.rollout.vllm.CPU_ENGINE_DEFAULTS says why)
        command += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
                    str(max(8192, max_model_len or 0))]
    return command


class ServerError(UserError):
    """A rollout server that cannot be reached or answered wrongly: one line, naming the server."""


def png_data_url(image) -> str:
    """An image as a lossless PNG data URL (the pixels our processor fitted to its patch grid, unchanged)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def video_loader(info: dict[str, Any]) -> str:
    """The video loader a server reads videos with, from its `/server_info?config_format=json`."""
    model = info.get("vllm_config", {}).get("model_config", {})
    kwargs = ((model.get("multimodal_config") or {}).get("media_io_kwargs") or {}).get("video") or {}
    return kwargs.get("video_backend") or info.get("vllm_env", {}).get("VLLM_VIDEO_LOADER_BACKEND") or "opencv"


def generate_payload(request: PromptRequest, sampling_kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """The JSON body of one `/inference/v1/generate` request: our folded ids, our images and videos (the frames and
    metadata our processor sampled), vLLM's sampling options."""
    media = request.payload.get("multi_modal_data", {})
    params = dict(sampling_kwargs, seed=seed)
    if "logit_bias" in params:  # JSON has no -inf; vLLM clamps nothing here, and -1e9 is -inf after softmax
        params["logit_bias"] = {str(k): max(float(v), -1e9) for k, v in params["logit_bias"].items()}
    body: dict[str, Any] = {"token_ids": list(request.payload["prompt_token_ids"]), "sampling_params": params,
                            "return_token_ids": True, "output_mode": "tokens"}
    parts = [{"type": "image_url", "url": png_data_url(image)} for image in media.get("image") or []]
    parts += [{"type": "video_url", "url": frames_data_url(frames, metadata)} for frames, metadata in
              media.get("video") or []]
    if parts:
        body["content_parts"] = parts
    return body


def response_samples(response: dict[str, Any], request: PromptRequest, n: int, where: str) -> list[EngineSample]:
    """The `n` completions of one generate response, after checking that the server ran our prompt ids."""
    check_prompt(response.get("prompt_token_ids"), request)
    choices = sorted(response.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != n:
        raise EngineError(f"{request.name}: {where} returned {len(choices)} completions, expected n={n}")
    samples = []
    for choice in choices:
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = None
        if content is not None:
            if [int(c["token_id"]) for c in content] != ids:
                raise EngineError(f"{request.name}: {where}'s logprobs do not follow its sampled tokens")
            logprobs = [float(c["logprob"]) for c in content]
        samples.append(EngineSample(ids, logprobs, str(choice.get("finish_reason"))))
    return samples


@dataclass(frozen=True)
class PreparedCall:
    """A generate call's requests with their JSON bodies (`ServerEngine.prepare`), not yet sent."""

    requests: list[PromptRequest]
    bodies: list[dict[str, Any]]
    sampling: SamplingParams
    asked: int  # completions asked per request (1 when greedy: the n are all the same)


@dataclass
class Server:
    url: str
    outstanding: int = 0  # requests sent and not answered
    served: int = 0  # requests answered
    alive: bool = True


class ServerPool:
    """The rollout servers, each request to the live one with the fewest outstanding requests."""

    def __init__(self, urls: Sequence[str], timeout_s: float, session_factory: Callable[[], Any] | None = None):
        if not urls:
            raise ConfigError("config: rollout.engine=vllm_server needs rollout.server_urls, e.g. "
                              "[http://127.0.0.1:8000]; start the servers with the command `vlrft serve-command` prints")
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._local = threading.local()
        self._session_factory = session_factory

    def session(self):
        """One HTTP session per thread (requests' sessions are not thread-safe)."""
        if getattr(self._local, "session", None) is None:
            import requests

            self._local.session = (self._session_factory or requests.Session)()
        return self._local.session

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """Every server answers `/health`; else one line naming the first that does not (before any model loads)."""
        import requests

        for server in self.servers:
            try:
                reply = self.session().get(server.url + "/health", timeout=timeout_s)
            except requests.RequestException as exc:
                raise ServerError(f"rollout server {server.url} is unreachable ({type(exc).__name__}); start it with "
                                  "the command `vlrft serve-command` prints, or fix rollout.server_urls") from None
            if reply.status_code != 200:
                raise ServerError(f"rollout server {server.url} answered /health with HTTP {reply.status_code}; "
                                  "is it a vLLM server that finished starting?")

    def check_video_loader(self) -> None:
        """Every server reads videos with vlrft's loader (`/server_info`, served with VLLM_SERVER_DEV_MODE=1 as the
        weight-sync routes are); else one line naming the first that does not, before any video is sent."""
        for server in self.live:
            reply = self.session().get(server.url + "/server_info", params={"config_format": "json"},
                                       timeout=self.timeout_s)
            if reply.status_code != 200:
                raise ServerError(f"rollout server {server.url} answered /server_info with HTTP {reply.status_code}; "
                                  "start it with VLLM_SERVER_DEV_MODE=1 (the command `vlrft serve-command` prints)")
            loader = video_loader(reply.json())
            if loader != VIDEO_BACKEND:
                raise ServerError(f"rollout server {server.url} reads videos with vLLM's {loader!r} loader, which "
                                  "samples frames of its own; restart it with --media-io-kwargs "
                                  f"'{{\"video\": {{\"video_backend\": \"{VIDEO_BACKEND}\"}}}}' (the command "
                                  "`vlrft serve-command` prints) to train on videos")

    @property
    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def acquire(self) -> Server:
        with self._lock:
            live = self.live
            if not live:
                raise ServerError(f"every rollout server stopped answering ({', '.join(s.url for s in self.servers)})"
                                  "; restart them and resume the run (train.resume=auto)")
            server = min(live, key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def release(self, server: Server, failed: bool) -> None:
        with self._lock:
            server.outstanding -= 1
            if failed and server.alive:
                server.alive = False
                logger.warning("rollout server %s stopped answering; its requests go to the %d others", server.url,
                               len(self.live))

    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to one live server, moving to another when one does not answer (a server that answers with an
        error is not retried: the request itself is wrong)."""
        import requests

        while True:
            server = self.acquire()
            try:
                reply = self.session().post(server.url + route, json=body, timeout=self.timeout_s)
            except requests.RequestException as exc:
                self.release(server, failed=True)
                last = f"{server.url}: {type(exc).__name__}"
                if not self.live:
                    raise ServerError(f"rollout server {last}; no rollout server is left (rollout.server_timeout_s="
                                      f"{self.timeout_s:g}); restart them and resume (train.resume=auto)") from None
                continue
            self.release(server, failed=False)
            server.served += 1
            if reply.status_code != 200:
                raise ServerError(f"rollout server {server.url}{route} answered HTTP {reply.status_code}: "
                                  f"{reply.text[:300]}")
            return reply.json() | {"_server": server.url}


@dataclass(frozen=True)
class ServerEngineOptions:
    seed: int  # the run's seed (train.seed); requests are seeded from it, the rank and the call count
    rank: int
    dtype: Any = None  # torch dtype weights are sent in (model.dtype); None: each tensor's own
    bucket_bytes: int = 512 << 20
    gather: Callable | None = None  # the strategy's context for reading sharded parameters whole (ZeRO-3)
    max_concurrency: int = 64  # requests in flight from this rank
    barrier: Callable[[], None] | None = None  # the trainer's ranks meet here before a sync pauses the servers


class ServerEngine:
    """A `RolloutEngine` over vLLM servers (see the module docstring). The weights live on the servers: a sync
    pushes them through `sync` (`vlrft.rollout.weight_transfer`), and every completion records its weight version."""

    def __init__(self, pool: ServerPool, tokens: "TokenSpec", tokenizer, options: ServerEngineOptions,
                 build_requests: Callable[["PromptBatch"], list[PromptRequest]], sync=None):
        self.pool = pool
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.options = options
        self.build_requests = build_requests
        self.sync = sync  # WeightSync on the rank that sends weights; None elsewhere (it only counts versions)
        self.version = 0  # the servers' weight version: 0 = as loaded from model.path, +1 per sync
        self._generate_calls = 0
        self._lock = threading.Lock()
        self._videos_checked = False  # the servers read videos with vlrft's loader (checked at the first video)
        self.last_sync = None  # the `SyncStats` of the last sync this rank sent
        # A sync waits for the generate calls in flight and holds new ones back: vLLM's pause ("wait") drains the
        # requests its scheduler runs, but keeps the ones still queued for after the resume, on the new weights.
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._syncing = False
        self._pool: ThreadPoolExecutor | None = None  # `_senders`

    @classmethod
    def from_deps(cls, cfg, deps) -> "ServerEngine":
        r = cfg.rollout
        pool = ServerPool(r.server_urls, r.server_timeout_s)
        pool.check_reachable()
        wrappers = image_wrappers(deps.processor)
        tokens = deps.tokens
        from vlrft.rollout.colocate import DTYPES

        options = ServerEngineOptions(seed=cfg.train.seed, rank=deps.strategy.rank, dtype=DTYPES[cfg.model.dtype],
                                      bucket_bytes=r.weight_sync_bucket_mb << 20, gather=deps.strategy.gathered,
                                      barrier=deps.strategy.barrier if deps.strategy.world_size > 1 else None)
        engine = cls(pool, tokens, deps.processor.tokenizer, options,
                     build_requests=lambda batch: vllm_requests(batch, tokens, wrappers))
        if deps.strategy.rank == 0:  # the sending rank drives vLLM's weight-transfer protocol on every server
            from vlrft.rollout.weight_transfer import ServerWeightSync, transport_for

            engine.sync = ServerWeightSync([s.url for s in pool.servers], timeout=r.server_timeout_s, transport=
                                           transport_for(r.weight_transfer, r.weight_transfer_address,
                                                         r.weight_transfer_port))
        if deps.sync_weights_at_start:
            engine.update_weights(deps.actor)
        return engine

    # ------------------------------------------------------------------ sampling

    def request_seed(self, call: int, prompt: int) -> int:
        """The colocated vLLM engine's seed for the same call and prompt (one engine per rank: train.seed + rank)."""
        from vlrft.sampling import request_seed

        return request_seed(self.options.seed + self.options.rank, call, prompt)

    def generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        return self.send(self.prepare(batch, sampling))

    def prepare(self, batch: "PromptBatch", sampling: SamplingParams) -> "PreparedCall":
        """Everything of a generate call that no weights decide: the requests and their JSON bodies (images as PNG).
        An asynchronous producer prepares its next step's call while the trainer still trains (`send` waits for
        no weights)."""
        from vlrft.rollout.vllm import vllm_sampling_kwargs

        requests = self.build_requests(batch)
        asked = 1 if sampling.greedy else sampling.n  # vLLM refuses n > 1 when greedy; the n are all the same
        kwargs = vllm_sampling_kwargs(dataclasses.replace(sampling, n=asked), self.tokens)
        if not self._videos_checked and any(r.payload.get("multi_modal_data", {}).get("video") for r in requests):
            self.pool.check_video_loader()
            self._videos_checked = True
        bodies = [generate_payload(req, kwargs, seed=0) for req in requests]  # seeds: at `send`
        return PreparedCall(requests, bodies, sampling, asked)

    def send(self, prepared: "PreparedCall") -> Rollouts:
        """Send a prepared call's requests (seeded by the call's number) and collect their completions, all sampled
        by the weight version current when they were sent."""
        requests, sampling, asked = prepared.requests, prepared.sampling, prepared.asked
        with self._idle:  # no sync starts while this call's requests are out, so they all run on `version`
            while self._syncing:
                self._idle.wait()
            self._generate_calls += 1
            call, version = self._generate_calls, self.version
            self._in_flight += 1
        try:
            for p, body in enumerate(prepared.bodies):
                body["sampling_params"]["seed"] = self.request_seed(call, p)
            replies = list(self._senders().map(lambda body: self.pool.post(GENERATE_ROUTE, body), prepared.bodies))
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()
        samples = [s for reply, req in zip(replies, requests)
                   for s in response_samples(reply, req, asked, f"rollout server {reply['_server']}")
                   for _ in range(sampling.n // asked)]
        stop_ids = set(self.tokens.eos_ids) | {int(i) for i in sampling.stop_token_ids}
        rollouts = to_rollouts(samples, sampling.n, stop_ids, sampling.max_new_tokens,
                               lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                               [r.name for r in requests])
        rollouts.weight_versions = [version] * len(rollouts)
        return rollouts

    def _senders(self) -> ThreadPoolExecutor:
        """The threads that wait for the servers' answers: kept across calls, so each keeps its HTTP session (and
        its connection) instead of opening new ones every step."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="vlrft-rollout")
            return self._pool

    # ------------------------------------------------------------------ weights

    def update_weights(self, model) -> None:
        """Push the policy's weights to every server as version `version + 1` (every rank walks the weights: a
        sharded policy is gathered collectively; only the sending rank talks to the servers). New generate calls
        are held back at once; the first bucket is staged while the calls in flight finish, and the servers pause
        once every rank's are answered (`_quiesce`), so each completion is sampled by the version it records."""
        from vlrft.models.weights import PolicyWeights

        with self._idle:
            self._syncing = True
        try:
            weights = PolicyWeights(model, self.options.dtype, self.options.gather)
            buckets = weights.buckets(self.options.bucket_bytes, "cpu")
            if self.sync is not None:  # the first bucket is staged while this rank's requests are still out
                self.last_sync = self.sync.sync(buckets, str(self.version + 1), before_pause=self._quiesce)
            elif weights.sharded:  # gathering shards is collective: every rank walks the buckets, and meets the
                for count, bucket in enumerate(buckets):  # sending rank's wait after the first, as it does
                    del bucket
                    if count == 0:
                        self._quiesce()
            else:
                self._quiesce()
            with self._lock:
                self.version += 1
        finally:
            with self._idle:
                self._syncing = False
                self._idle.notify_all()

    def _quiesce(self) -> None:
        """Wait for this rank's generate calls in flight (new ones are held), then for every rank's: the servers
        pause with none of our requests running or queued."""
        with self._idle:
            while self._in_flight:
                self._idle.wait()
        if self.options.barrier is not None:
            self.options.barrier()

    def sleep(self) -> None:
        """The servers keep their memory (they are not on the trainer's devices)."""

    def wake(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"generate_calls": self._generate_calls, "weight_version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self._generate_calls = int(state["generate_calls"])
        self.version = int(state.get("weight_version", self.version))

    def close(self) -> None:
        """The servers are not ours: they keep running."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

"""What the vLLM / SGLang engines must do around the engine calls, on CPU, each a bug a GPU run would hit.

The engines cannot run here, so `RecordingSGLangEngine` and `RecordingLLM` stand in for
`sglang.Engine` and `vllm.LLM` (method names and keywords as in SGLang 0.5.23 / vLLM 0.32; the
contract tests in tests/test_engine_contracts.py check those against the real packages) and record
what vlrft asks of them. `RecordingBackend` (from test_rollout_engines) records a colocated
engine's backend calls.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _stand_ins import RecordingBackend
from vlrft.config import Config, DataConfig
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.colocate import ColocatedEngine, EngineOptions, GroupComm, RankLayout
from vlrft.rollout.hf import TokenSpec
from vlrft.rollout.outputs import EngineError
from vlrft.rollout.requests import PromptRequest, pixel_bounds
from vlrft.rollout.sglang import SGLangBackend, check_status, sglang_engine_kwargs
from vlrft.rollout.vllm import VLLMBackend, vllm_engine_kwargs

TOKENS = TokenSpec(pad_id=0, eos_ids=(2,), image_token_id=6, video_token_id=7)


@dataclass
class StandInLocalSerializedTensor:
    """Stand-in for sglang's LocalSerializedTensor: `values[k]` is TP rank k's payload."""

    values: list


@dataclass
class FlushCacheReqOutput:
    """Stand-in for sglang's FlushCacheReqOutput (success, message)."""

    success: bool
    message: str = ""


class RecordingSGLangEngine:
    """Stand-in for `sglang.Engine`: records the weight/memory calls; answers as SGLang 0.5.23 does.

    Like the real engine, it refuses `update_weights_from_tensor` outside a weight-update session.
    """

    def __init__(self, flush_ok: bool = True):
        self.calls: list = []
        self.session = False
        self.flush_ok = flush_ok

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append("begin_weight_update")
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end_weight_update")
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [name for name, _ in named_tensors], flush_cache))
        self.last = named_tensors
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush_cache")
        return FlushCacheReqOutput(self.flush_ok, "" if self.flush_ok else "requests are still running")

    def release_memory_occupation(self, tags=None):
        self.calls.append("release")

    def resume_memory_occupation(self, tags=None):
        self.calls.append("resume")


class RecordingLLM:
    """Stand-in for `vllm.LLM` 0.32 (cache resets, wake-up): records the calls. As there, the encoder
    cache is reset through `llm_engine`, and `wake_up` answers whether the engine is fully awake."""

    def __init__(self, prefix_reset_ok: bool = True, fully_awake: bool = True):
        self.calls: list[str] = []
        self.prefix_reset_ok = prefix_reset_ok
        self.fully_awake = fully_awake
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("reset_encoder_cache"))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append("reset_prefix_cache")
        return self.prefix_reset_ok

    def reset_mm_cache(self) -> None:
        self.calls.append("reset_mm_cache")

    def wake_up(self, tags=None) -> bool:
        self.calls.append(f"wake_up:{tags}")
        return self.fully_awake or tags == ["weights"]


@pytest.fixture(scope="module")
def policy(tiny_vlm_dir):
    from vlrft.models.loading import load_policy

    return load_policy(tiny_vlm_dir("qwen2_vl"))


def sglang_engine(policy, recorder, sleep=True) -> ColocatedEngine:
    layout = RankLayout(0, 1, 1)
    backend = SGLangBackend(recorder, TOKENS, local_tensor=StandInLocalSerializedTensor)
    return ColocatedEngine(backend, lambda batch: [], layout, GroupComm(layout), lambda: policy, None, TOKENS,
                           EngineOptions(torch.float32, "cpu", sleep_between_steps=sleep, bucket_bytes=64 << 10),
                           every_rank_drives=False, pack_bucket=lambda bucket: list(bucket))


# ---------------------------------------------------------------------------------------------- SGLang weights


def test_sglang_weight_update_runs_in_one_session_then_flushes(policy):
    from vlrft.models.weights import PolicyWeights

    recorder = RecordingSGLangEngine()
    sglang_engine(policy, recorder).update_weights(policy)
    updates = [c for c in recorder.calls if isinstance(c, tuple)]
    assert len(updates) > 1  # several buckets ...
    assert recorder.calls[0] == "begin_weight_update"  # ... all inside one session
    assert recorder.calls[-2:] == ["end_weight_update", "flush_cache"]
    assert recorder.calls.count("begin_weight_update") == 1 and not recorder.session
    assert all(flush is False for _, _, flush in updates)  # the cache is flushed once, at the end
    sent = [name for _, names, _ in updates for name in names]
    assert sorted(sent) == sorted(PolicyWeights(policy, torch.float32).names)
    # Each weight travels as one payload per tensor-parallel rank (here one rank: the tensor itself).
    name, wrapped = recorder.last[0]
    assert isinstance(wrapped, StandInLocalSerializedTensor) and len(wrapped.values) == 1
    assert torch.equal(wrapped.values[0], dict(policy.named_parameters()).get(name, wrapped.values[0]))


def test_sglang_refusal_raises_with_the_engines_message(policy):
    recorder = RecordingSGLangEngine()
    recorder.begin_weight_update = lambda selector="all": (False, "weight updates are disabled on this server")
    with pytest.raises(EngineError, match="SGLang begin_weight_update failed: weight updates are disabled"):
        sglang_engine(policy, recorder).update_weights(policy)
    assert not any(isinstance(c, tuple) for c in recorder.calls)  # nothing sent outside a session


def test_sglang_failed_update_raises_and_closes_the_session(policy):
    recorder = RecordingSGLangEngine()
    real_update = recorder.update_weights_from_tensor

    def fail_second(named_tensors, load_format=None, flush_cache=True):
        real_update(named_tensors, load_format, flush_cache)
        if sum(isinstance(c, tuple) for c in recorder.calls) == 2:
            return False, "Failed to update weights: shape mismatch for model.layers.0.mlp.up_proj.weight"
        return True, "Success"

    recorder.update_weights_from_tensor = fail_second
    engine = sglang_engine(policy, recorder)
    with pytest.raises(EngineError, match="update_weights_from_tensor failed: .*shape mismatch"):
        engine.update_weights(policy)
    assert recorder.calls[-1] == "end_weight_update" and not engine.weights_current
    engine.update_weights(policy)  # the next update opens a fresh session and goes through
    assert recorder.calls[-2:] == ["end_weight_update", "flush_cache"]


def test_sglang_refused_flush_raises(policy):
    with pytest.raises(EngineError, match="SGLang flush_cache failed: requests are still running"):
        sglang_engine(policy, RecordingSGLangEngine(flush_ok=False)).update_weights(policy)


def test_check_status_reads_every_answer_shape():
    check_status((True, "Success"), "x")
    check_status(None, "x")  # release/resume report nothing
    check_status(FlushCacheReqOutput(True), "x")
    with pytest.raises(EngineError, match="SGLang x failed: boom"):
        check_status((False, "boom"), "x")
    with pytest.raises(EngineError, match="SGLang y failed: no message"):
        check_status(FlushCacheReqOutput(False), "y")


@pytest.mark.slow
@pytest.mark.distributed
def test_sglang_tensor_parallel_sync_sends_one_payload_per_rank(tmp_path, tiny_vlm_dir):
    rank0, rank1 = run_sync_ranks(tmp_path, str(tiny_vlm_dir("qwen2_vl")), fail_update="no session is open")
    updates = [c for c in rank0["calls"] if isinstance(c, dict)]
    assert rank0["calls"][0] == "begin_weight_update" and rank0["calls"][-2:] == ["end_weight_update", "flush_cache"]
    names = [name for update in updates for name in update]
    assert names and rank1["calls"] is None  # only the leader talks to the engine
    for update in updates:
        for name, values in update.items():
            assert values == [f"rank0:{name}", f"rank1:{name}"]  # TP worker k loads rank k's copy
    # A refused update (second sync) raises SGLang's message on every member: nobody waits forever.
    assert rank0["error"] == rank1["error"] == "SGLang update_weights_from_tensor failed: no session is open"


def run_sync_ranks(tmp_path, model_dir: str, fail_update: str) -> list[dict]:
    import torch.multiprocessing as mp

    from sglang_sync_ranks import worker

    context = mp.start_processes(worker, args=(str(tmp_path), model_dir, fail_update), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the tensor-parallel weight sync hung")
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


# ---------------------------------------------------------------------------------------------- vLLM caches


def test_vllm_weight_load_resets_prefix_and_multimodal_caches():
    llm = RecordingLLM()
    VLLMBackend(llm, TOKENS, owns_distributed=False).weights_loaded()
    # Encoder outputs are reused by image hash: without the multimodal reset, images keep the old vision tower.
    assert llm.calls == ["reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache"]


def test_vllm_refused_prefix_reset_raises():
    with pytest.raises(EngineError, match="refused to reset its prefix cache"):
        VLLMBackend(RecordingLLM(prefix_reset_ok=False), TOKENS, owns_distributed=False).weights_loaded()


def test_vllm_without_an_encoder_cache_reset_refuses_to_go_on():
    llm = RecordingLLM()
    llm.llm_engine = SimpleNamespace()
    with pytest.raises(EngineError, match="old vision tower"):
        VLLMBackend(llm, TOKENS, owns_distributed=False).weights_loaded()


def test_vllm_wake_up_that_leaves_the_engine_asleep_raises():
    backend = VLLMBackend(RecordingLLM(fully_awake=False), TOKENS, owns_distributed=False)
    backend.resume_weights()  # a partial wake: not fully awake is expected here
    with pytest.raises(EngineError, match="not fully awake"):
        backend.resume_cache()


# ---------------------------------------------------------------------------------------------- memory


class StandInTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(row) for row in ids]


def colocated(policy, calls, seed=0, requests=1) -> ColocatedEngine:
    layout = RankLayout(0, 1, 1)
    return ColocatedEngine(RecordingBackend(calls=calls),
                           lambda batch: [PromptRequest({}, [1, 2], f"p{i}") for i in range(requests)],
                           layout, GroupComm(layout), lambda: policy, StandInTokenizer(), TOKENS,
                           EngineOptions(torch.float32, "cpu", bucket_bytes=1 << 30, seed=seed),
                           every_rank_drives=True)


def test_cached_gpu_memory_is_freed_before_each_wake_up(policy, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = colocated(policy, calls)
    engine.sleep()
    engine.update_weights(policy)
    engine.wake()
    assert calls == ["release", "empty_cache", "resume_weights", "load", "weights_loaded", "empty_cache", "resume_cache"]


# ---------------------------------------------------------------------------------------------- pixel bounds


def test_engines_get_the_trainers_pixel_bounds(tiny_processor):
    processor = tiny_processor("qwen2_vl")  # its own bounds: 28*28 .. 28*28*16 pixels
    bounds = pixel_bounds(processor, DataConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1024))
    assert bounds["image"] == {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}  # the tighter of the two
    cfg = Config()
    cfg.model.path = "/m"
    kwargs = vllm_engine_kwargs(cfg, RankLayout(0, 1, 1), distributed=False, supported=set(), pixels=bounds)
    assert kwargs["mm_processor_kwargs"] == bounds["image"]
    cfg.rollout.engine_kwargs = {"mm_processor_kwargs": {"max_pixels": 1}}
    assert vllm_engine_kwargs(cfg, RankLayout(0, 1, 1), False, set(), bounds)["mm_processor_kwargs"] == \
        {"max_pixels": 1}  # the user's engine_kwargs win
    sglang = sglang_engine_kwargs(Config(), RankLayout(0, 1, 1), gpu_id=0, pixels=bounds)
    assert sglang["mm_process_config"]["image"] == bounds["image"]


def test_sglang_is_told_the_qwen2_vl_in_chans_a_transformers_5_folder_lacks(tiny_vlm_dir, tmp_path):
    # SGLang's Qwen2-VL reads vision_config.in_chans; transformers 5 saves only in_channels (vlrft checkpoints too).
    cfg = Config()
    cfg.model.path = str(tiny_vlm_dir("qwen2_vl"))
    kwargs = sglang_engine_kwargs(cfg, RankLayout(0, 1, 1), gpu_id=0)
    in_channels = json.loads((Path(cfg.model.path) / "config.json").read_text())["vision_config"]["in_channels"]
    assert json.loads(kwargs["json_model_override_args"]) == {"vision_config": {"in_chans": in_channels}}
    cfg.model.path = str(tiny_vlm_dir("qwen2_5_vl"))  # Qwen2.5-VL's SGLang class reads in_channels: nothing to add
    assert "json_model_override_args" not in sglang_engine_kwargs(cfg, RankLayout(0, 1, 1), gpu_id=0)
    cfg.model.path = "Qwen/Qwen2-VL-7B-Instruct"  # a Hub id: its config.json has both names
    assert "json_model_override_args" not in sglang_engine_kwargs(cfg, RankLayout(0, 1, 1), gpu_id=0)
    cfg.model.path = str(tiny_vlm_dir("qwen2_vl"))
    cfg.rollout.engine_kwargs = {"json_model_override_args": "{}"}  # the user's own overrides win
    assert sglang_engine_kwargs(cfg, RankLayout(0, 1, 1), gpu_id=0)["json_model_override_args"] == "{}"


# ---------------------------------------------------------------------------------------------- tensor parallel


def test_tensor_parallel_members_draw_identical_random_numbers(policy):
    """Two members of one TP group (same engine seed) whose trainers' generators diverged sample alike."""
    member_a, member_b = colocated(policy, [], seed=42), colocated(policy, [], seed=42)
    other_group = colocated(policy, [], seed=43)
    for engine, trainer_seed in ((member_a, 1), (member_b, 2), (other_group, 1)):
        for _ in range(2):
            torch.manual_seed(trainer_seed)  # the trainer seeds `seed + rank` and uses its RNG between calls
            torch.rand(trainer_seed)
            before = torch.random.get_rng_state()
            engine.generate(None, SamplingParams(n=1, max_new_tokens=2))
            assert torch.equal(torch.random.get_rng_state(), before)  # the trainer's stream is untouched
    draws_a, draws_b = member_a.backend.draws, member_b.backend.draws
    assert draws_a == draws_b  # identical streams inside the group
    assert draws_a[0] != draws_a[1]  # a new stream every call
    assert other_group.backend.draws != draws_a  # other engines sample independently


def test_an_empty_group_batch_runs_nothing_and_returns_no_rollouts(policy):
    calls: list[str] = []
    engine = colocated(policy, calls, requests=0)
    rollouts = engine.generate(None, SamplingParams(n=3))
    assert len(rollouts) == 0 and rollouts.n == 3 and not any(c.startswith("run") for c in calls)


class CountingEngine:
    """Stand-in rollout engine: counts `generate` calls and returns empty rollouts for empty batches."""

    def __init__(self):
        self.batch_sizes: list[int] = []

    def generate(self, batch, sampling):
        from vlrft.rollout.base import Rollouts

        self.batch_sizes.append(len(batch))
        assert len(batch) == 0, "this stand-in only answers empty batches"
        return Rollouts(n=sampling.n, completion_ids=[], finish_reasons=[], logprobs=[])


@pytest.fixture
def empty_encoder(tiny_processor):
    """A real PromptEncoder; `encode([])` gives the real empty PromptBatch."""
    from vlrft.data import PromptEncoder

    encoder = PromptEncoder(tiny_processor("qwen2_vl"), DataConfig())
    empty = encoder.encode([]).batch
    assert len(empty) == 0
    return SimpleNamespace(encode=lambda samples: SimpleNamespace(batch=empty, skipped=list(samples)))


@pytest.mark.parametrize("rank", [0, 1])
def test_evaluation_calls_generate_equally_often_on_every_rank(rank, empty_encoder):
    from vlrft.trainer.evaluate import EvalDeps, evaluate

    engine = CountingEngine()
    gathered = []  # the reward-failure agreement is a collective too: as often on every rank
    deps = EvalDeps(samples=list(range(5)), rank=rank, world_size=2,  # rank 0 gets 3 samples, rank 1 gets 2
                    encoder=empty_encoder, engine=engine, sampling=SamplingParams(), batch_prompts=2,
                    rewards=None, accuracy_key="acc", reduce=lambda t: t,
                    gather_objects=lambda obj: gathered.append(obj) or [obj])
    metrics = evaluate(deps, step=0)
    assert len(engine.batch_sizes) == 2  # ceil(3 / 2) on both ranks, although rank 1's share fits one batch
    assert gathered == [None, None]
    assert metrics["eval/skipped"] == (3.0 if rank == 0 else 2.0)


def test_collect_generates_even_when_a_rounds_batch_is_empty(empty_encoder):
    from vlrft.parallel.strategy import Strategy
    from vlrft.trainer.collect import CollectDeps, collect

    cfg = Config()
    engine = CountingEngine()
    deps = CollectDeps(algo=cfg.algorithm, rollout=cfg.rollout, prompts_per_rank=1, samples=["s"],
                       sampler=SimpleNamespace(next_indices=lambda: [0]), encoder=empty_encoder, engine=engine,
                       sampling=SamplingParams(), rewards=SimpleNamespace(keys=[]), strategy=Strategy())
    with pytest.raises(Exception, match="could not collect 1 usable prompts"):
        collect(deps, step=1)
    # Every round called the engine (a tensor-parallel peer with prompts would otherwise wait forever).
    from vlrft.trainer.collect import MAX_ROUNDS_FOR_SKIPS

    assert engine.batch_sizes == [0] * MAX_ROUNDS_FOR_SKIPS


def test_a_scoring_bug_is_told_to_every_rank_and_raised_as_it_is_on_its_own(monkeypatch):
    """Not a reward error but a bug while scoring: its rank re-raises it with its own traceback, and the other
    ranks (here, the gathered list's second entry stands for them) learn its type and message."""
    from vlrft.trainer import collect as collect_module

    def broken_score(*args):
        raise ValueError("index out of range in my reward recipe")

    monkeypatch.setattr(collect_module, "score", broken_score)
    told = []
    with pytest.raises(ValueError, match="index out of range"):
        collect_module.score_on_every_rank(None, ["a prompt"], None, 1, 3, lambda obj: told.append(obj) or [obj, None])
    assert told == ["rank 3: ValueError: index out of range in my reward recipe"]



def test_vllm_on_a_cpu_refuses_heads_narrower_than_its_kernels_in_one_line(tiny_vlm_dir):
    """vLLM's CPU attention takes heads of >= 32 dimensions; a narrower model is refused before the engine is built
    (it used to fail minutes later inside vLLM), and a wide enough one passes."""
    from vlrft.errors import UserError
    from vlrft.models.loading import load_policy
    from vlrft.rollout.vllm import check_cpu_attention

    narrow = load_policy(tiny_vlm_dir("qwen2_vl"))
    head_dim = narrow.config.text_config.hidden_size // narrow.config.text_config.num_attention_heads
    assert head_dim < 32
    with pytest.raises(UserError, match=rf"heads of at least 32 dimensions, and this model's have {head_dim}") as caught:
        check_cpu_attention(SimpleNamespace(model=narrow))
    assert "\n" not in str(caught.value)
    wide = load_policy(tiny_vlm_dir("qwen2_vl", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256))
    check_cpu_attention(SimpleNamespace(model=wide))

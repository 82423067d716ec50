"""FSDP2 under torchrun (2 processes, gloo on CPU): the same training as one process, sharded.

Most runs use the `ScriptedEngine` test double (tests/scripted_engine.py): completions are a fixed
function of the prompt, so a 2-rank run and a single-process run see the same global batch and
their weights can be compared after each optimizer step. One run uses the real hf engine.
The tiny model ties its embeddings to the LM head, the case a sharded load and sync get wrong.
"""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _data_helpers import mixed_prompts
from _sharded_sync import assert_lora_sync_merges_the_adapters
from _sharded_runs import (assert_close, assert_runs_match_single, assert_sync_sends_the_single_process_state_dict,
                          run_args, sharded_setup, single_process_run, weights)
from _torchrun import run_plan, torchrun

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_vlm_dir):
    return sharded_setup(tmp_path_factory.mktemp("fsdp2"), tiny_vlm_dir("qwen2_vl", tie_word_embeddings=True), "fsdp2")


@pytest.fixture(scope="module")
def sharded(setup):
    """One torchrun launch: A (3 steps, micro-batch 4, weight sync after), B (1 step, micro-batch 1), C (hf engine),
    O (A with offloading during rollout)."""
    start = time.perf_counter()
    results = run_plan(setup["folder"], 2, [
        run_args(setup, "A", sync_out=str(setup["folder"] / "sync.pt")),
        run_args(setup, "B", "train.total_steps=1", "train.micro_batch_completions_per_rank=1", watch_gradients=True),
        run_args(setup, "C", "train.total_steps=2", "train.eval_every=2", "train.micro_batch_completions_per_rank=2",
                 scripted=False),
        # as A, with the shards and optimizer state copied to host memory and back around every rollout
        run_args(setup, "O", "rollout.engine=vllm", "train.fsdp.offload_during_rollout=true", new_strategy=True),
    ])
    return {"A": results[0]["history"], "B": results[1]["history"], "C": results[2]["history"],
            "B_gradients_sharded": results[1]["gradients_sharded_after_each_backward"],
            "O": results[3]["history"], "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def single(setup):
    """The same run as A in this process (strategy single), with the same scripted completions."""
    return single_process_run(setup)


def test_fsdp2_weights_equal_the_single_process_run_after_1_and_3_steps(setup, sharded, single):
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    for step in (1, 3):
        fsdp, one = weights(setup, "A", step), weights(setup, "S", step)
        assert_close(fsdp, one)
        assert max((fsdp[k] - initial[k]).abs().max().item() for k in fsdp) > 1e-4  # training moved the weights
    for ours, theirs in zip(sharded["A"], single["history"]):
        # the gradient norm is the global one (over both ranks' shards), as in one process
        assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4)
        assert ours["reward/mean"] == pytest.approx(theirs["reward/mean"], rel=1e-6)


def test_offloading_during_rollout_trains_bitwise_like_without(setup, sharded):
    for step in (1, 2, 3):
        ours, plain = weights(setup, "O", step), weights(setup, "A", step)
        assert sorted(ours) == sorted(plain)
        assert all(torch.equal(ours[k], plain[k]) for k in ours), step
    assert [h["actor/grad_norm"] for h in sharded["O"]] == [h["actor/grad_norm"] for h in sharded["A"]]


def test_fsdp2_micro_batch_1_and_4_give_the_same_weights(setup, sharded):
    assert_close(weights(setup, "B", 1), weights(setup, "A", 1))


def test_accumulated_gradients_stay_sharded_after_every_micro_batch(sharded):
    """Run B: 8 micro-batches of one completion per rank. After each backward every trained parameter holds its
    reduced shard of the gradient; FSDP2's no-sync accumulation would keep whole float32 gradients on every rank
    (on a GPU, the whole model's gradients: +31 GiB per GPU for 7B) until the last micro-batch."""
    assert sharded["B_gradients_sharded"] == [True] * 8


def test_weight_sync_from_fsdp2_shards_sends_the_single_process_state_dict(setup, sharded, single):
    assert_sync_sends_the_single_process_state_dict(setup, single, "A", 3)
    sent = torch.load(setup["folder"] / "sync.pt")
    # A bfloat16 engine's sync: each shard is cast before it is gathered (half the bytes), same values
    assert sent["gathered_dtypes_bf16"] == ["torch.bfloat16"]
    assert sent["gathered_devices_bf16"] == ["cpu"]  # where the shards are: nothing moved on a CPU mesh
    assert sorted(sent["received_bf16"]) == sorted(sent["received"])
    assert all(torch.equal(sent["received_bf16"][k], v.to(torch.bfloat16)) for k, v in sent["received"].items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: train.fsdp.cpu_offload keeps the shards in "
                    "host memory under a CUDA device mesh, which a CPU machine cannot build")
def test_an_offloaded_fsdp2_policy_is_gathered_on_the_gpu_for_weight_sync(setup):
    """With train.fsdp.cpu_offload the shards live in host memory; the weight sync moves each to the GPU before
    gathering it (NCCL), instead of gathering host tensors over the process group's gloo backend."""
    run_plan(setup["folder"], 1, [run_args(setup, "OFFLOAD", "train.total_steps=1", "train.fsdp.cpu_offload=true",
                                           sync_out=str(setup["folder"] / "sync_offload.pt"))])
    sent = torch.load(setup["folder"] / "sync_offload.pt")
    assert sent["gathered_devices_bf16"] == ["cuda"]
    saved = weights(setup, "OFFLOAD", 1)
    assert all(torch.equal(sent["received"][k], saved[k]) for k in saved)
    assert all(torch.equal(sent["received_bf16"][k], v.to(torch.bfloat16)) for k, v in sent["received"].items())


def test_fsdp2_trains_with_the_hf_engine_and_evaluates(setup, sharded):
    steps = [h for h in sharded["C"] if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    assert all(h["completions/mean_length"] > 0 and h["actor/grad_norm"] > 0 for h in steps)
    assert 0 <= steps[-1]["eval/accuracy"] <= 1
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    trained = weights(setup, "C", 2)
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4


def single_run(setup, name: str, *overrides: str):
    """The run `name` in this process (strategy single) with the scripted completions: (trainer, history)."""
    from scripted_engine import ScriptedEngine

    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    cfg = load_config(setup["config"], [f"train.output_dir={setup['folder'] / name}", "train.strategy=single",
                                        *overrides])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
        trainer = Trainer(cfg)
        return trainer, trainer.fit()


def test_fsdp2_shards_reference_critic_and_lora_like_one_process(setup):
    """PPO (critic + reference) and LoRA under FSDP2 equal one process; also LoRA on the LM head tied to the
    embeddings (its weight is a read-only property PEFT's wrapper has, which transformers' re-tying cannot set)."""
    folder = setup["folder"]
    ppo = ["train.total_steps=1", "algorithm.advantage=gae", "algorithm.kl_coef=0.1"]
    lora = ["train.total_steps=1", "model.lora.rank=4", "train.lr=1e-2"]
    head = [*lora, "model.lora.target_modules=[q_proj,lm_head]"]
    results = run_plan(folder, 2, [run_args(setup, "PPO", *ppo),
                                   run_args(setup, "LORA", *lora, sync_out=str(folder / "sync_lora.pt"),
                                            watch_loads=True),
                                   run_args(setup, "HEAD", *head)])
    _, head_single = single_run(setup, "HEAD-single", *head)
    assert results[2]["history"][0]["actor/grad_norm"] == pytest.approx(head_single[0]["actor/grad_norm"], rel=1e-4)
    # with LoRA too, only rank 0 reads the weights (into host memory) and the others build the model on the meta
    # device: no device holds the whole model before sharding (it held it whole on every GPU: 125 GiB for 32B)
    [(rank0_bytes, rank0_devices)], [(rank1_bytes, _)] = results[1]["loads_per_rank"]
    assert rank0_bytes > 0 and rank0_devices == ["cpu"] and rank1_bytes == 0
    for name, overrides in (("PPO", ppo), ("LORA", lora)):
        trainer, history = single_run(setup, name + "-single", *overrides)
        if name == "LORA":
            single_lora = trainer  # what one process's weight sync of the trained LoRA policy sends
        if name == "PPO":  # the reference's forward left no gathered copy of its weights behind
            assert results[0]["reference_resharded"] is True
        ours = results[0 if name == "PPO" else 1]["history"][0]
        assert ours["actor/grad_norm"] == pytest.approx(history[0]["actor/grad_norm"], rel=1e-4)
        if name == "PPO":  # the critic was sharded and trained too
            assert ours["critic/value_loss"] == pytest.approx(history[0]["critic/value_loss"], rel=1e-4)
        file = "adapter_model.safetensors" if name == "LORA" else "model.safetensors"
        sharded_weights = load_file(folder / name / "checkpoints" / "step_1" / "model" / file)
        single_weights = load_file(folder / (name + "-single") / "checkpoints" / "step_1" / "model" / file)
        assert_close(sharded_weights, single_weights, atol=1e-5 if name == "PPO" else 1e-4)
    # vLLM/SGLang weight sync of the LoRA policy: the merge reads the adapters' DTensor shards
    assert_lora_sync_merges_the_adapters(torch.load(folder / "sync_lora.pt"), single_lora, setup["model"])


def test_fsdp2_trains_mixed_image_and_text_only_prompts_like_one_process(setup):
    """No hang when one rank (or one micro-batch) has no image: its vision blocks run on a dummy image.

    Prompts: `mixed_prompts` (step 1: rank 0 images only, rank 1 text only). Micro-batch 8 puts a rank's two prompts in one micro-batch (step 2: a micro-batch mixing an
    image and a text-only prompt); micro-batch 4 gives each prompt its own, so in step 2 rank 0
    encodes an image in its first micro-batch and rank 1 in its second. The reference model (KL)
    runs its no-grad forwards the same way. Weights equal the single-process run after each step.
    One more run samples with the hf engine (generation on the gathered policy) and trains a step.
    """
    folder = setup["folder"]
    mixed = mixed_prompts(folder)
    common = [f"data.train_files=[{mixed}]", "data.shuffle=false", "train.total_steps=2", "algorithm.kl_coef=0.1"]
    start = time.perf_counter()
    results = run_plan(folder, 2, [run_args(setup, "MIX8", *common, "train.micro_batch_completions_per_rank=8"),
                                   run_args(setup, "MIX4", *common),
                                   # the hf engine generates with the gathered policy: rank 1 skips the tower there
                                   run_args(setup, "MIXHF", *common, "train.total_steps=1", scripted=False)])
    hf = results.pop()["history"]
    assert hf[-1]["step"] == 1 and hf[-1]["completions/mean_length"] > 0 and hf[-1]["actor/grad_norm"] > 0
    seconds = time.perf_counter() - start
    _, single = single_run(setup, "MIX-single", *common)
    assert_runs_match_single(setup, "MIX-single", ("MIX8", "MIX4"), steps=(1, 2))
    for run in results:
        for ours, theirs in zip(run["history"], single):
            assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4)
            assert ours["actor/kl_ref"] == pytest.approx(theirs["actor/kl_ref"], rel=1e-4, abs=1e-7)
    assert seconds < 240, seconds  # finished (a hang would hit the torchrun timeout)


def test_a_sharded_checkpoint_resumes_bitwise_on_2_ranks(setup, sharded):
    resume = setup["folder"] / "A" / "checkpoints" / "step_1"
    history = run_plan(setup["folder"], 2, [run_args(setup, "R2", f"train.resume={resume}")])[0]["history"]
    assert [h["step"] for h in history] == [2, 3]
    final, expected = weights(setup, "R2", 3), weights(setup, "A", 3)
    assert sorted(final) == sorted(expected)
    assert all(torch.equal(final[k], expected[k]) for k in final)


def test_checkpoints_without_the_hf_export_resume_bitwise_from_the_sharded_files(setup, sharded):
    """train.save_hf_model=last: only the final checkpoint gets model/ (rank 0 writes it alone, 288 GB of float32 for a
    72B policy). A resume starts from model.path and restores the weights from sharded/, LoRA adapters included:
    the same weights as the uninterrupted run. The engine (which started from model.path) is put to sleep before the
    optimizer state comes back, then synced once to the restored weights, and counts its calls on from the
    checkpoint's (vLLM/SGLang seed each call with that count)."""
    folder = setup["folder"]
    lora = ["model.lora.rank=4", "train.lr=1e-2", "train.total_steps=2"]
    fresh = run_plan(folder, 2, [run_args(setup, "L", "train.save_hf_model=last"),
                                 run_args(setup, "LL", "train.save_hf_model=last", *lora)])
    assert fresh[0]["engine_calls_before_first_generate"] == ["wake"]
    assert [(folder / "L" / "checkpoints" / f"step_{k}" / "model").exists() for k in (1, 2, 3)] == [False, False, True]
    final, expected = weights(setup, "L", 3), weights(setup, "A", 3)
    assert all(torch.equal(final[k], expected[k]) for k in expected)  # writing model/ or not changes no weight
    results = run_plan(folder, 2, [
        run_args(setup, "RL", "train.save_hf_model=last", f"train.resume={folder / 'L' / 'checkpoints' / 'step_1'}"),
        run_args(setup, "RLL", "train.save_hf_model=last", *lora,
                 f"train.resume={folder / 'LL' / 'checkpoints' / 'step_1'}")])
    assert [h["step"] for h in results[0]["history"]] == [2, 3]
    assert results[0]["engine_calls_before_first_generate"] == ["sleep", "restored 1", "update", "wake"]
    resumed = weights(setup, "RL", 3)
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    # a LoRA checkpoint's sharded/ holds the adapters and their optimizer state, not the frozen base (from model.path)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder / "LL" / "checkpoints" / "step_1" / "sharded")).read_metadata()
    weights_saved = [k for k in saved.state_dict_metadata if k.startswith("policy.model.")]
    base_saved = [k for k in weights_saved if "lora_" not in k]
    assert any("lora_" in k for k in weights_saved)
    assert all(k.endswith(".lm_head.weight") for k in base_saved), base_saved  # tied to the embeddings: torch keeps it
    adapters = [load_file(folder / run / "checkpoints" / "step_2" / "model" / "adapter_model.safetensors")
                for run in ("LL", "RLL")]
    assert sorted(adapters[0]) == sorted(adapters[1]) and all(torch.equal(adapters[0][k], adapters[1][k])
                                                              for k in adapters[0])


def test_a_2_rank_checkpoint_resumes_on_1_rank(setup, sharded):
    resume = setup["folder"] / "A" / "checkpoints" / "step_1"
    history = run_plan(setup["folder"], 1, [run_args(setup, "R1", f"train.resume={resume}")])[0]["history"]
    assert [h["step"] for h in history] == [2, 3]
    assert_close(weights(setup, "R1", 3), weights(setup, "A", 3))
    for ours, theirs in zip(history, sharded["A"][1:]):
        for key in ("reward/mean", "actor/grad_norm", "entropy", "actor/kl_ref"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_a_bfloat16_checkpoint_is_read_in_bfloat16_and_loads_the_same_float32_weights(tmp_path, tiny_vlm_dir):
    """Rank 0 reads a bfloat16 release in bfloat16 (half the host memory of a float32 copy); the float32 shards get
    exactly the values a one-process float32 load gives, buffers (rotary inv_freq) included."""
    import shutil

    from vlrft.models.loading import load_policy

    source = Path(tiny_vlm_dir("qwen2_5_vl"))
    folder = tmp_path / "bf16"
    shutil.copytree(source, folder)
    for weights_file in folder.glob("*.safetensors"):
        weights_file.unlink()
    load_policy(source, dtype="bfloat16").save_pretrained(folder)
    out = tmp_path / "loaded.pt"
    proc = torchrun("fsdp_worker.py", "load", str(folder), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(out)
    assert loaded["read"] == ["bfloat16"]
    one = load_policy(folder, dtype="float32")
    expected = dict(one.named_parameters())
    assert sorted(loaded["params"]) == sorted(expected)
    for name, value in loaded["params"].items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name].detach()), name
    expected_buffers = dict(one.named_buffers())
    assert loaded["buffers"].keys() == expected_buffers.keys()
    for name, value in loaded["buffers"].items():
        assert value.dtype == expected_buffers[name].dtype and torch.equal(value, expected_buffers[name]), name


def test_the_read_dtype_comes_from_the_tensors_then_from_the_config(tmp_path, tiny_vlm_dir):
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vlrft.parallel.fsdp2 import _read_dtype
    from vlrft.parallel.strategy import ModelSource

    folder = Path(tiny_vlm_dir("qwen2_5_vl"))  # float32 tensors
    config = AutoConfig.from_pretrained(folder)
    config.dtype = torch.bfloat16  # a config that says bfloat16 over float32 tensors: the tensors decide
    assert _read_dtype(ModelSource(folder, "float32"), config) == "float32"
    # Not a local folder (a Hub id): Qwen3-VL's config keeps its dtype in text_config only
    text_only = SimpleNamespace(dtype=None, get_text_config=lambda: SimpleNamespace(dtype="bfloat16"))
    assert _read_dtype(ModelSource("Qwen/Qwen3-VL-4B-Instruct", "float32"), text_only) == "bfloat16"
    assert _read_dtype(ModelSource("Qwen/Qwen3-VL-4B-Instruct", "bfloat16"), text_only) == "bfloat16"
    float16 = SimpleNamespace(dtype=torch.float16)  # same width as the model's bfloat16: read as the model's
    assert _read_dtype(ModelSource("some/model", "bfloat16"), float16) == "bfloat16"


def test_one_failing_rank_ends_the_whole_job(tmp_path):
    start = time.perf_counter()
    proc = torchrun("fsdp_worker.py", "fail", timeout=180)
    elapsed = time.perf_counter() - start
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr
    assert elapsed < 120, elapsed


def test_fsdp2_trains_in_the_gpus_mixed_precision(setup, sharded, monkeypatch):
    """The GPUs' default precision on CPU ranks (VLRFT_CPU_MIXED_PRECISION=1, model.dtype bfloat16): FSDP2 gathers
    the weights in bf16 (its MixedPrecisionPolicy, over gloo) and reduces float32 gradients, the reference is bf16
    and the hf engine samples from the gathered bf16 policy. With run A's scripted completions the first step's
    gradient norm is within 5 % of the float32 one and not equal to it (bf16 was in effect); the hf run trains.
    model/ (an export under FSDP2) is written in model.dtype by default: the float32 weights a
    train.hf_model_dtype=float32 export of the same run holds, rounded to bf16, bitwise."""
    from vlrft.models.precision import CPU_MIXED_PRECISION_ENV

    monkeypatch.setenv(CPU_MIXED_PRECISION_ENV, "1")
    mixed = ["model.dtype=bfloat16", "train.total_steps=1"]
    results = run_plan(setup["folder"], 2, [
        run_args(setup, "BF16", *mixed),
        run_args(setup, "BF16HF", *mixed, "algorithm.kl_coef=0.1", "train.micro_batch_completions_per_rank=2",
                 scripted=False),
        run_args(setup, "BF16F32", *mixed, "train.hf_model_dtype=float32")])
    ours, fp32 = results[0]["history"][0], sharded["A"][0]
    assert ours["actor/grad_norm"] == pytest.approx(fp32["actor/grad_norm"], rel=0.05)
    assert ours["actor/grad_norm"] != pytest.approx(fp32["actor/grad_norm"], rel=1e-5)
    hf = results[1]["history"][0]
    assert hf["completions/mean_length"] > 0 and hf["actor/grad_norm"] > 0 and math.isfinite(hf["kl"])
    exported, full = weights(setup, "BF16", 1), weights(setup, "BF16F32", 1)
    assert sorted(exported) == sorted(full)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], full[k].to(torch.bfloat16))
               for k in full)
    config = json.loads((setup["folder"] / "BF16" / "checkpoints" / "step_1" / "model" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in full.values())
    assert max((full[k] - initial[k]).abs().max().item() for k in full) > 1e-4  # it trained
    assert weights(setup, "BF16HF", 1)[next(iter(full))].dtype == torch.bfloat16


def test_an_output_folder_that_is_not_shared_by_every_rank_is_refused_at_start(setup):
    """Node-local disks (here: a folder per rank) would fail at the first checkpoint, hours in: refused at start,
    naming the ranks that cannot see rank 0's folder."""
    result = run_plan(setup["folder"], 2, [
        run_args(setup, "LOCAL", f"train.output_dir={setup['folder'] / 'LOCAL' / 'node{rank}'}")])[0]
    assert "history" not in result
    assert "is not the same folder on every rank: rank 1 on" in result["error"] and "rank 0 on" not in result["error"]


def test_a_checkpoint_of_another_strategy_is_refused_before_any_model_loads(setup, sharded, single, monkeypatch):
    """FSDP2 resumes from sharded/, single/DDP from model/ and optimizer.pt: a checkpoint of the other kind is named
    with the way out at start, not after minutes of loading a large model (or as a raw error from DCP)."""
    from vlrft.config import load_config
    from vlrft.errors import UserError
    from vlrft.trainer import Trainer

    folder = setup["folder"]
    [refused] = run_plan(folder, 1, [run_args(setup, "X", f"train.resume={folder / 'S' / 'checkpoints' / 'step_1'}")])
    assert "no FSDP2 checkpoint in" in refused["error"] and "train.strategy=fsdp2" in refused["error"]
    loads = []
    monkeypatch.setattr("vlrft.trainer.trainer.load_processor", lambda *a, **k: loads.append(1))
    cfg = load_config(setup["config"], [f"train.output_dir={folder / 'Y'}", "train.strategy=single",
                                        f"train.resume={folder / 'A' / 'checkpoints' / 'step_1'}"])
    with pytest.raises(UserError, match="has no optimizer.pt: it was not written with train.strategy=single"):
        Trainer(cfg)
    assert loads == []  # refused before the processor (or any model) loads


def test_a_lora_checkpoint_as_model_path_trains_on_under_fsdp2(setup):
    """model.path may name a LoRA run's checkpoint model/ (an adapter folder, no config.json of its own): rank 0
    merges it into its base, and the other ranks build their meta model from the base's config."""
    folder = setup["folder"]
    lora = ["train.total_steps=1", "model.lora.rank=4", "train.lr=1e-2"]
    run_plan(folder, 2, [run_args(setup, "LORA0", *lora)])
    adapter = folder / "LORA0" / "checkpoints" / "step_1" / "model"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    [again] = run_plan(folder, 2, [run_args(setup, "LORA1", *lora, f"model.path={adapter}")])
    assert "error" not in again, again.get("error")
    assert again["history"][0]["step"] == 1 and again["history"][0]["actor/grad_norm"] > 0

"""DeepSpeed ZeRO-2/ZeRO-3 under torchrun (2 processes, gloo, DeepSpeed's CPU accelerator).

The training runs use the `ScriptedEngine` test double (tests/scripted_engine.py): completions are
a fixed function of the prompt, so a 2-rank run and a single-process run see the same global
batch and their weights can be compared after each optimizer step. The tiny model ties its
embeddings to the LM head, the case a sharded load and weight sync get wrong. The runs go through
tests/fsdp_worker.py, which runs any strategy the config names.
"""

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _data_helpers import mixed_prompts
from _sharded_sync import assert_lora_sync_merges_the_adapters
from _sharded_runs import (assert_close, assert_sync_sends_the_single_process_state_dict, needs_deepspeed, run_args,
                          sharded_setup, single_process_run, weights)
from _torchrun import failure_output, run_plan, torchrun

REPO = Path(__file__).resolve().parents[1]


def test_missing_deepspeed_is_one_clear_error(monkeypatch):
    from vlrft.parallel import make_strategy
    from vlrft.errors import UserError

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what `import deepspeed` sees when it is not installed
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}.items():
        monkeypatch.setenv(var, value)  # as under torchrun: the package check comes before any process group
    with pytest.raises(UserError, match=r"train.strategy=deepspeed needs the deepspeed package .*vlrft\[deepspeed\]"):
        make_strategy("deepspeed")


def test_deepspeed_options_are_validated():
    from vlrft.config import ConfigError, load_config

    assert load_config(None, ["train.strategy=deepspeed"], world_size=2).train.deepspeed.zero_stage == 3
    assert load_config(None, ["train.strategy=deepspeed", "train.hf_model_dtype=bfloat16"], world_size=2)
    with pytest.raises(ConfigError, match=r"train.hf_model_dtype='bfloat16' is not allowed; expected 'auto' or "
                                          r"'float32' with train.strategy=ddp"):
        load_config(None, ["train.strategy=ddp", "train.hf_model_dtype=bfloat16"], world_size=2)
    with pytest.raises(ConfigError, match=r"train.deepspeed.zero_stage=1 is not allowed; expected an integer in \[2, 3\]"):
        load_config(None, ["train.strategy=deepspeed", "train.deepspeed.zero_stage=1"])
    with pytest.raises(ConfigError, match=r"train.deepspeed.offload_param=True is not allowed; expected false with "
                                          r"zero_stage=2"):
        load_config(None, ["train.strategy=deepspeed", "train.deepspeed.zero_stage=2",
                           "train.deepspeed.offload_param=true"])


@needs_deepspeed
def test_the_deepspeed_config_keeps_the_trainers_autocast_and_a_low_precision_reference():
    """DeepSpeed switches an outer CUDA autocast off inside its forward unless the config's `torch_autocast` is on
    (deepspeed.runtime.torch_autocast.autocast_if_enabled; CPU tests cannot see it, that check reads CUDA's
    autocast only), and zero.Init casts the reference to float32 unless its bf16 section is on. With bf16 compute:
    trained engines get torch_autocast, as DeepSpeed's own parser reads it, with no module reduced in bf16, and the
    reference stays bf16; with float32 compute neither."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import get_lower_precision_safe_modules, get_torch_autocast_dtype, \
        get_torch_autocast_enabled

    from vlrft.parallel.deepspeed import DeepSpeedStrategy

    def ds_config(compute_dtype, trainable):
        strategy = SimpleNamespace(stage=3, offload_optimizer=False, offload_param=False, max_grad_norm=1.0,
                                   micro_batch_size=2, device=torch.device("cuda", 0), compute_dtype=compute_dtype)
        return DeepSpeedStrategy.ds_config(strategy, trainable=trainable)

    trained, reference = ds_config(torch.bfloat16, True), ds_config(torch.bfloat16, False)
    assert get_torch_autocast_enabled(trained) and get_torch_autocast_dtype(trained) == torch.bfloat16
    assert get_lower_precision_safe_modules(trained) == [] and not trained["bf16"]["enabled"]
    assert reference["bf16"]["enabled"] and not get_torch_autocast_enabled(reference)
    for config in (ds_config(torch.float32, True), ds_config(torch.float32, False)):
        assert not get_torch_autocast_enabled(config) and not config["bf16"]["enabled"]


def torchrun_test(test):
    """A test that launches torchrun with DeepSpeed (skipped with the reason when deepspeed cannot import)."""
    return pytest.mark.distributed(pytest.mark.slow(needs_deepspeed(test)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_vlm_dir):
    return sharded_setup(tmp_path_factory.mktemp("deepspeed"), tiny_vlm_dir("qwen2_vl", tie_word_embeddings=True),
                         "deepspeed")


@pytest.fixture(scope="module")
def zero(setup):
    """One torchrun launch: Z3 (3 steps, micro-batch 4, weight sync after), Z3B (1 step, micro-batch 1),
    Z3H (the real hf engine generating from the gathered ZeRO-3 policy), Z3L (loaded, not trained, then
    a weight sync), Z2 (ZeRO-2, as Z3)."""
    start = time.perf_counter()
    results = run_plan(setup["folder"], 2, [
        run_args(setup, "Z3", sync_out=str(setup["folder"] / "sync.pt")),
        run_args(setup, "Z3B", "train.total_steps=1", "train.micro_batch_completions_per_rank=1"),
        run_args(setup, "Z3H", "train.total_steps=2", "train.eval_every=2", "train.micro_batch_completions_per_rank=2",
                 scripted=False),
        run_args(setup, "Z3L", "train.total_steps=0", sync_out=str(setup["folder"] / "sync_loaded.pt")),
        run_args(setup, "Z2", "train.deepspeed.zero_stage=2", new_strategy=True),
    ])
    for result in results:  # a run the worker refused (a UserError): show it, not a KeyError 'history'
        assert "history" in result, result
    return {"Z3": results[0]["history"], "Z3B": results[1]["history"], "Z3H": results[2]["history"],
            "Z2": results[4]["history"], "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def single(setup):
    """The same run in this process (strategy single), with the same scripted completions."""
    return single_process_run(setup)


@torchrun_test
@pytest.mark.parametrize("run", ["Z2", "Z3"])
def test_zero_weights_equal_the_single_process_run_after_1_and_3_steps(setup, zero, single, run):
    # the run used the stage it names: ZeRO-3 writes each rank's weight shard, ZeRO-2 one whole copy
    state = setup["folder"] / run / "checkpoints" / "step_1" / "deepspeed" / "policy" / "state"
    shard_files = {"Z2": ["mp_rank_00_model_states.pt"],
                   "Z3": [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]}[run]
    assert sorted(p.name for p in state.glob("*model_states.pt")) == shard_files
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    for step in (1, 3):
        ours, one = weights(setup, run, step), weights(setup, "S", step)
        assert_close(ours, one)
        assert max((ours[k] - initial[k]).abs().max().item() for k in ours) > 1e-4  # training moved the weights
    for ours, theirs in zip(zero[run], single["history"]):
        # the gradient norm is the global one (over both ranks' shards), as in one process
        assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4)
        assert ours["reward/mean"] == pytest.approx(theirs["reward/mean"], rel=1e-6)


@torchrun_test
def test_zero3_micro_batch_1_and_4_give_the_same_weights(setup, zero):
    assert_close(weights(setup, "Z3B", 1), weights(setup, "Z3", 1))


@torchrun_test
def test_weight_sync_from_zero3_shards_sends_the_single_process_state_dict(setup, zero, single):
    assert_sync_sends_the_single_process_state_dict(setup, single, "Z3", 3)


@torchrun_test
def test_weight_sync_right_after_a_zero3_load_sends_exactly_the_single_process_state_dict(setup, zero):
    """zero.Init loading and the bucketed gather lose nothing: bitwise the weights one process loads."""
    from vlrft.models.loading import load_policy
    from vlrft.models.weights import PolicyWeights

    sent = torch.load(setup["folder"] / "sync_loaded.pt")
    assert sent["duplicates"] == []
    expected = {name: t for bucket in PolicyWeights(load_policy(setup["model"]), torch.float32).buckets(1 << 30, "cpu")
                for name, t in bucket}
    assert "lm_head.weight" not in expected and "lm_head.weight" not in sent["received"]  # tied: sent once
    assert sorted(sent["received"]) == sorted(expected)
    assert all(torch.equal(sent["received"][k], expected[k]) for k in expected)


@torchrun_test
def test_zero3_trains_with_the_hf_engine_and_evaluates(setup, zero):
    steps = [h for h in zero["Z3H"] if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    assert all(h["completions/mean_length"] > 0 and h["actor/grad_norm"] > 0 for h in steps)
    assert 0 <= steps[-1]["eval/accuracy"] <= 1
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    trained = weights(setup, "Z3H", 2)
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4


@torchrun_test
def test_zero3_trains_critic_reference_and_lora_like_one_process(setup):
    """PPO (critic + ZeRO-3 reference) and LoRA under ZeRO-3 equal one process (mixed image and text-only
    steps: test_zero3_trains_mixed_image_and_text_only_prompts_like_one_process). The LoRA policy is built inside
    zero.Init like any ZeRO-3 policy (no rank ever holds it whole: 125 GiB per GPU for 32B when it did), and a
    LoRA checkpoint resumes onto that partitioned base like one process."""
    from scripted_engine import ScriptedEngine

    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    folder = setup["folder"]
    ppo = ["train.total_steps=1", "algorithm.advantage=gae", "algorithm.kl_coef=0.1"]
    lora = ["train.total_steps=1", "model.lora.rank=4", "train.lr=1e-2"]
    resumed = ["model.lora.rank=4", "train.lr=1e-2", "train.total_steps=2"]
    results = run_plan(folder, 2, [run_args(setup, "PPO", *ppo),
                                   run_args(setup, "LORA", *lora, sync_out=str(folder / "sync_lora.pt"),
                                            watch_loads=True),
                                   run_args(setup, "LORA-R", *resumed,
                                            f"train.resume={folder / 'LORA' / 'checkpoints' / 'step_1'}")])
    # what each rank's load returned, before PEFT and DeepSpeed: ZeRO-3 shards only (a partitioned parameter's own
    # data is empty; its shard lives in ds_tensor), where it was the whole float32 policy on every rank
    [(rank0_bytes, _)], [(rank1_bytes, _)] = results[1]["loads_per_rank"]
    assert rank0_bytes == 0 and rank1_bytes == 0
    for name, overrides in (("PPO", ppo), ("LORA", lora)):
        cfg = load_config(setup["config"], [f"train.output_dir={folder / (name + '-single')}", "train.strategy=single",
                                            *overrides])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
            trainer = Trainer(cfg)
            history = trainer.fit()
        if name == "LORA":
            single_lora = trainer  # what one process's weight sync of the trained LoRA policy sends
        run = results[0 if name == "PPO" else 1]
        assert "history" in run, run  # the worker caught a UserError: show it (seen once in a CI rehearsal)
        ours = run["history"][0]
        assert ours["actor/grad_norm"] == pytest.approx(history[0]["actor/grad_norm"], rel=1e-4)
        if name == "PPO":  # the critic was a ZeRO-3 engine and trained too; the reference gave the same KL
            assert ours["critic/value_loss"] == pytest.approx(history[0]["critic/value_loss"], rel=1e-4)
            assert ours["actor/kl_ref"] == pytest.approx(history[0]["actor/kl_ref"], rel=1e-4, abs=1e-7)
        file = "adapter_model.safetensors" if name == "LORA" else "model.safetensors"
        ours_saved = load_file(folder / name / "checkpoints" / "step_1" / "model" / file)
        single_saved = load_file(folder / (name + "-single") / "checkpoints" / "step_1" / "model" / file)
        # 1e-4 = 10 % of one AdamW step at lr 1e-3: Adam's first step turns float noise in near-zero gradients into
        # visible weight moves (measured up to 1.6e-5 here); the grad-norm / value-loss / KL checks above are tight
        assert_close(ours_saved, single_saved, atol=1e-4)
    # vLLM/SGLang weight sync of the LoRA policy: ZeRO-3 partitions the adapters too, gathered with each weight
    assert_lora_sync_merges_the_adapters(torch.load(folder / "sync_lora.pt"), single_lora, setup["model"])
    cfg = load_config(setup["config"], [f"train.output_dir={folder / 'LORA-R-single'}", "train.strategy=single",
                                        *resumed, f"train.resume={folder / 'LORA-single' / 'checkpoints' / 'step_1'}"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
        single_resumed = Trainer(cfg).fit()
    assert "history" in results[2], results[2]
    [ours] = results[2]["history"]
    assert ours["step"] == 2
    assert ours["actor/grad_norm"] == pytest.approx(single_resumed[0]["actor/grad_norm"], rel=1e-4)


@torchrun_test
def test_a_zero3_checkpoint_resumes_bitwise_on_2_ranks(setup, zero):
    resume = setup["folder"] / "Z3" / "checkpoints" / "step_1"
    history = run_plan(setup["folder"], 2, [run_args(setup, "R2", f"train.resume={resume}")])[0]["history"]
    assert [h["step"] for h in history] == [2, 3]
    final, expected = weights(setup, "R2", 3), weights(setup, "Z3", 3)
    assert sorted(final) == sorted(expected)
    assert all(torch.equal(final[k], expected[k]) for k in final)


@torchrun_test
def test_a_2_rank_zero3_or_zero2_checkpoint_resumes_on_1_rank(setup, zero):
    """Through DeepSpeed's universal checkpoint format (converted on first use)."""
    results = run_plan(setup["folder"], 1, [
        run_args(setup, "R1", f"train.resume={setup['folder'] / 'Z3' / 'checkpoints' / 'step_1'}"),
        run_args(setup, "R1Z2", f"train.resume={setup['folder'] / 'Z2' / 'checkpoints' / 'step_1'}",
                 "train.deepspeed.zero_stage=2", new_strategy=True),
    ])
    for (run, written), result in zip((("R1", "Z3"), ("R1Z2", "Z2")), results):
        history = result["history"]
        assert [h["step"] for h in history] == [2, 3]
        assert_close(weights(setup, run, 3), weights(setup, written, 3))
        for ours, theirs in zip(history, zero[written][1:]):
            for key in ("reward/mean", "actor/grad_norm", "entropy", "actor/kl_ref"):
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory) -> dict:
    """One torchrun launch of tests/deepspeed_worker.py: the NaN skip under ZeRO-2 and 3, NaN in ZeRO-3 padding."""
    out = tmp_path_factory.mktemp("nonfinite") / "skip.json"
    proc = torchrun("deepspeed_worker.py", str(out), timeout=240, outputs=(out,))
    assert proc.returncode == 0, failure_output(proc)
    return json.loads(out.read_text())


@torchrun_test
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank_for_every_part(nonfinite_runs):
    for stage in ("zero2", "zero3"):
        run = nonfinite_runs[stage]
        # step 2: NaN gradients from rank 1's policy; step 3: rank 1 only reports a non-finite loss
        assert run["skipped"] == [False, True, True, False], stage
        assert run["unchanged"] == [False, True, True, False], stage  # policy and critic both untouched
        # the optimizer state survived the skips: steps 1 and 4 equal one process that never saw 2 and 3
        assert run["max_diff"] < 1e-6, stage


@torchrun_test
def test_nan_bits_in_zero3_shard_padding_do_not_stop_the_run_but_a_nan_weight_does(nonfinite_runs):
    """DeepSpeed leaves shard padding uninitialized; checking it made PPO runs (critic value-head bias: 1 element,
    all padding on rank 1) stop at random with "the optimizer step made the weights non-finite"."""
    padding = nonfinite_runs["padding"]
    assert padding["padding_holds_nan"]  # the case is really there
    assert padding["padding_nan_judged_finite"]
    assert padding["padding_nan_left_out_of_the_norm"]  # nor by the norm-change check (vlrft.trainer.update)
    assert padding["real_nan_seen"]  # the check still catches a diverged weight


@torchrun_test
def test_zero3_trains_mixed_image_and_text_only_prompts_like_one_process(setup):
    """No hang when one rank (or micro-batch) has no image: ZeRO-3 gathers vision blocks per call, so that rank
    runs them on a dummy image. Weights equal one process after each step (reference forwards included)."""
    from vlrft.config import load_config
    from vlrft.trainer import Trainer
    from scripted_engine import ScriptedEngine

    folder = setup["folder"]
    common = [f"data.train_files=[{mixed_prompts(folder)}]", "data.shuffle=false", "train.total_steps=2",
              "algorithm.kl_coef=0.1"]
    history = run_plan(folder, 2, [run_args(setup, "ZMIX", *common)])[0]["history"]
    cfg = load_config(setup["config"], [f"train.output_dir={folder / 'ZMIX-single'}", "train.strategy=single", *common])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
        single = Trainer(cfg).fit()
    for step in (1, 2):
        assert_close(weights(setup, "ZMIX", step), weights(setup, "ZMIX-single", step))
    for ours, theirs in zip(history, single):
        assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4)


@torchrun_test
def test_zero3_in_the_gpus_mixed_precision_trains_like_one_process_in_it(setup, zero, monkeypatch):
    """The GPUs' default precision on CPU ranks (VLRFT_CPU_MIXED_PRECISION=1, model.dtype bfloat16): bf16 autocast
    over ZeRO-3's float32 weights, a bf16 reference. With the scripted completions one step gives one process's
    gradient norm and entropy under the same autocast (1e-4), not the float32 ones; the hf engine samples from the
    gathered policy under the autocast and trains. (Weights are not compared: AdamW's first step moves a weight by
    about lr whatever its gradient's size, so bf16 noise on near-zero gradients flips such moves.)"""
    from scripted_engine import ScriptedEngine

    from vlrft.config import load_config
    from vlrft.models.precision import CPU_MIXED_PRECISION_ENV
    from vlrft.trainer import Trainer

    monkeypatch.setenv(CPU_MIXED_PRECISION_ENV, "1")
    mixed = ["model.dtype=bfloat16", "train.total_steps=1", "algorithm.kl_coef=0.1"]
    results = run_plan(setup["folder"], 2, [
        run_args(setup, "Z3MP", *mixed),
        run_args(setup, "Z3MPHF", *mixed, "train.micro_batch_completions_per_rank=2", scripted=False)])
    cfg = load_config(setup["config"], [f"train.output_dir={setup['folder'] / 'SMP'}", "train.strategy=single",
                                        *mixed])
    monkeypatch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
    single = Trainer(cfg).fit()
    ours = results[0]["history"][0]
    for key in ("actor/grad_norm", "actor/entropy"):
        assert ours[key] == pytest.approx(single[0][key], rel=1e-4), key
    assert ours["actor/grad_norm"] != pytest.approx(zero["Z3"][0]["actor/grad_norm"], rel=1e-5)
    hf = results[1]["history"][0]
    assert hf["completions/mean_length"] > 0 and hf["actor/grad_norm"] > 0 and math.isfinite(hf["kl"])
    # model/ is an export under ZeRO-3: written in model.dtype (train.hf_model_dtype=auto)
    assert all(t.dtype == torch.bfloat16 for t in weights(setup, "Z3MP", 1).values())

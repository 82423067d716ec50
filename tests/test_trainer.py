"""End-to-end training on CPU: outputs a user reads, exact resume, and the defined outcome of each fault."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlrft.config import load_config
from vlrft.errors import UserError
from vlrft.logging import read_metrics
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_processor
from vlrft.trainer import Trainer

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=24, test_size=8))


def config(tmp_path, model_dir, shapes, *overrides):
    base = [
        f"model.path={model_dir}", "model.dtype=float32",
        f"data.train_files=[{shapes['train']}]", f"data.eval_files=[{shapes['test']}]",
        "data.min_pixels=784", "data.max_pixels=3136",
        "rollout.n=4", "rollout.global_batch_completions=16", "rollout.max_new_tokens=5",
        f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
        f"train.output_dir={tmp_path / 'run'}", "train.total_steps=2", "train.lr=1e-3", "train.micro_batch_completions_per_rank=8",
        "train.eval_every=2", "train.eval_batch_prompts=8",
        "logging.progress=false", "logging.completions_every=1", "logging.completions_rows=3",
    ]
    return load_config(None, base + list(overrides))


def run(cfg):
    trainer = Trainer(cfg)
    history = trainer.fit()
    return trainer, history


REQUIRED = ("reward/mean", "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/region",
            "frac_reward_zero_std", "time/step", "time/generate", "time/train")


def test_a_run_leaves_metrics_tensorboard_completions_checkpoints_and_config(tmp_path, tiny_vlm_dir, shapes):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForImageTextToText

    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "logging.wandb_api_key=sk-TOPSECRET",
                 "algorithm.kl_coef=0.05")
    trainer, history = run(cfg)
    out = tmp_path / "run"
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in REQUIRED + ("kl", "reward/text_hash/mean"):
        assert key in metrics[1] and key in metrics[2], key
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[2] and "eval/reward/mean" in metrics[2]
    assert 0 <= metrics[2]["completions/clipped_ratio"] <= 1
    assert metrics[1]["completions/mean_length"] <= 5

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
    table = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(table) == 6 and {"prompt", "completion", "rewards", "advantage", "image"} <= set(table[0])
    assert (out / table[0]["image"]).is_file()

    saved = (out / "config.yaml").read_text()
    assert "TOPSECRET" not in saved and "kl_coef: 0.05" in saved
    final = out / "checkpoints" / "step_2" / "model"
    loaded = AutoModelForImageTextToText.from_pretrained(final)
    trained = trainer.actor.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def _without_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    # Off-policy PPO epochs, an adaptive KL controller, running reward normalisation and a cosine schedule:
    # every piece of state a resume must restore.
    extra = ["train.total_steps=4", "train.save_every=2", "train.ppo_epochs=2", "train.global_mini_batch_completions=8",
             "train.lr_scheduler=cosine", "algorithm.kl_coef=0.1", "algorithm.kl_controller=adaptive",
             "algorithm.normalize_rewards=true", "train.eval_temperature=1.0"]
    straight = config(tmp_path / "a", tiny_vlm_dir("qwen2_vl"), shapes, *extra)
    run(straight)

    interrupted = config(tmp_path / "b", tiny_vlm_dir("qwen2_vl"), shapes, *extra)
    original = Trainer.train_step

    def stop_after_two(self):
        if self.step_count == 2:
            raise KeyboardInterrupt  # the user stops the run after the step-2 checkpoint
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(interrupted)
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed_cfg = config(tmp_path / "b", tiny_vlm_dir("qwen2_vl"), shapes, *extra, "train.resume=auto")
    resumed, _ = run(resumed_cfg)
    assert resumed.resume_from.name == "step_2"

    a = load_file(tmp_path / "a" / "run" / "checkpoints" / "step_4" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "run" / "checkpoints" / "step_4" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _without_times(read_metrics(tmp_path / "a" / "run")) == _without_times(read_metrics(tmp_path / "b" / "run"))


def test_non_finite_loss_skips_the_update(tmp_path, tiny_vlm_dir, shapes, capsys):
    from vlrft.algo.losses import POLICY_LOSSES, _clipped_surrogate, register_policy_loss

    @register_policy_loss("nan_for_test")
    def nan_loss(cfg, logprobs, old_logprobs, advantages, mask):
        sur = _clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, 0.2, 0.2, None)
        return type(sur)(per_token=sur.per_token * float("nan"), clipped_low=sur.clipped_low,
                         clipped_high=sur.clipped_high)

    try:
        cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "algorithm.policy_loss=nan_for_test",
                     "train.total_steps=1", "train.eval_every=0")
        trainer = Trainer(cfg)
        before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
        trainer.fit()
        after = trainer.actor.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing applied
        assert read_metrics(tmp_path / "run")[-1]["optimizer/skipped_steps"] == 1.0
        assert "optimizer step is skipped on every rank" in capsys.readouterr().out
    finally:
        POLICY_LOSSES.pop("nan_for_test")


def test_a_node_below_the_plans_host_memory_is_warned_of_before_the_model_loads(tmp_path, tiny_vlm_dir, shapes,
                                                                                 monkeypatch, capsys):
    """On GPUs the trainer checks the plan at load (a no-op on CPU): here the plan of the tiny model is handed in
    as the GPU check would, on a node said to have 1 KiB."""
    from vlrft.plan import GiB, Hardware, plan_for_config

    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=1")
    plan = plan_for_config(cfg, Hardware(gpus_per_node=1, gpu_memory=80 * GiB))
    loaded = []
    media = []  # the data's most images and videos in a prompt, as the check is told them
    monkeypatch.setattr("vlrft.trainer.trainer.check_fits_at_load",
                        lambda cfg, world, images, videos: media.append((images, videos)) or plan)
    monkeypatch.setattr("vlrft.trainer.trainer.node_memory_bytes", lambda: 1 << 10)  # the tiny policy: 0.9 MB
    monkeypatch.setattr("vlrft.trainer.trainer.load_processor",
                        lambda *a, **k: loaded.append(capsys.readouterr().out) or load_processor(*a, **k))
    Trainer(cfg)
    assert loaded and "memory plan: the first node needs about" in loaded[0]  # said before anything loads
    assert "but has 0.0 GiB" in loaded[0] and "checkpoint_read" in loaded[0]
    assert media == [(1, 0)]  # the shapes data: one image per prompt, no video


def test_a_failing_reward_names_the_function_or_counts_as_not_applicable(tmp_path, tiny_vlm_dir, shapes):
    spec = f"reward.functions=[{{name: '{REWARDS}:broken'}}]"
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, spec, "train.total_steps=1", "train.eval_every=0")
    with pytest.raises(UserError, match="broken.*grader crashed"):
        run(cfg)
    cfg = config(tmp_path / "b", tiny_vlm_dir("qwen2_vl"), shapes, spec, "reward.on_error=none",
                 "train.total_steps=1", "train.eval_every=0", "train.eval_before_training=false")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    history = trainer.fit()
    assert history[-1]["reward/frac_not_applicable"] == 1.0
    # every failure is counted per function and step, in metrics.jsonl and TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert history[-1]["reward/broken/errors"] == 16.0 == read_metrics(tmp_path / "b" / "run")[-1]["reward/broken/errors"]
    events = EventAccumulator(str(tmp_path / "b" / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/broken/errors")] == [(1, 16.0)]
    assert all(math.isfinite(v) for v in history[-1].values())  # no signal, and no NaN either
    after = trainer.actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dynamic_sampling_replaces_zero_variance_groups(tmp_path, tiny_vlm_dir, shapes):
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes,
                 f"reward.functions=[{{name: '{REWARDS}:constant_unless_yellow'}}]", "algorithm.dynamic_sampling=true",
                 "algorithm.max_refill_rounds=3", "train.total_steps=2", "train.eval_every=0",
                 "train.eval_before_training=false")
    trainer, history = run(cfg)
    for m in history:
        # three prompts in four have zero variance, so more prompts were drawn, up to the refill budget ...
        assert m["frac_reward_zero_std"] >= 0.5 and 2 <= m["rollout/rounds"] <= 4
        # ... and when the budget ran out, zero-variance groups filled the batch (zero advantage, no 0/0)
        assert m["dynamic_sampling/filled_zero_std"] == 0 or m["rollout/rounds"] == 4
        assert math.isfinite(m["actor/pg_loss"])


def test_zero_advantage_rows_are_left_out_of_the_update_by_default_with_the_same_weights(tmp_path, tiny_vlm_dir,
                                                                                          shapes):
    """train.skip_zero_advantage_rows (on by default) reaches the update: groups whose rewards are all equal are
    counted as left out, and the weights equal a run that trains on them."""
    runs = {}
    for skip in (True, False):
        cfg = config(tmp_path / str(skip), tiny_vlm_dir("qwen2_vl"), shapes,
                     f"reward.functions=[{{name: '{REWARDS}:constant_unless_yellow'}}]", "train.total_steps=1",
                     "train.eval_every=0", "train.eval_before_training=false", f"train.skip_zero_advantage_rows={skip}")
        trainer, history = run(cfg)
        runs[skip] = (history[0], [p.detach().clone() for p in trainer.actor.parameters()])
    (left_out, weights), (trained_all, full_weights) = runs[True], runs[False]
    assert left_out["frac_reward_zero_std"] > 0
    assert left_out["actor/zero_advantage_rows_skipped"] == pytest.approx(left_out["frac_reward_zero_std"])
    assert "actor/zero_advantage_rows_skipped" not in trained_all
    assert left_out["reward/mean"] == trained_all["reward/mean"]  # the same rollouts
    for a, b in zip(weights, full_weights):  # AdamW's first step moves every weight by ~lr (1e-3) times a sign
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_over_long_prompts_are_skipped_and_counted_or_refused(tmp_path, tiny_vlm_dir, shapes):
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "data.max_prompt_length=10", "train.total_steps=1",
                 "train.eval_every=0", "train.eval_before_training=false")
    with pytest.raises(UserError, match=r"tokens.*data.max_prompt_length=10"):
        run(cfg)
    cfg = config(tmp_path / "b", tiny_vlm_dir("qwen2_vl"), shapes, "data.max_prompt_length=10",
                 "data.on_bad_sample=skip", "train.total_steps=1", "train.eval_every=0",
                 "train.eval_before_training=false")
    with pytest.raises(UserError, match="could not collect 4 usable prompts .* skipped"):
        run(cfg)


def test_truncated_completions_are_flagged_and_can_be_masked(tmp_path, tiny_vlm_dir, shapes):
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "rollout.max_new_tokens=1", "algorithm.mask_truncated=true",
                 "train.total_steps=1", "train.eval_every=0", "train.eval_before_training=false")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    m = trainer.fit()[-1]
    # a random model almost never stops on its first token: every completion hits the limit, is flagged ...
    assert m["completions/max_length"] == 1.0 and m["completions/clipped_ratio"] == 1.0
    # ... and, masked, trains nothing
    after = trainer.actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_ppo_with_a_critic_lora_and_gradient_checkpointing_train(tmp_path, tiny_vlm_dir, shapes):
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "algorithm.advantage=gae", "rollout.n=1",
                 "rollout.global_batch_completions=4", "train.total_steps=2", "train.eval_every=0", "train.eval_before_training=false",
                 "model.lora.rank=4", "model.gradient_checkpointing=true", "train.ppo_epochs=2")
    trainer = Trainer(cfg)
    lora = {n: p.clone() for n, p in trainer.actor.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)  # only the adapters train
    # the critic, a second whole model, recomputes its activations too (and so its forward caches no weight casts)
    assert trainer.critic.actor_like.model.is_gradient_checkpointing and trainer.actor.model.is_gradient_checkpointing
    value_head = trainer.critic.value_head.weight.clone()
    history = trainer.fit()
    assert all(math.isfinite(h["critic/value_loss"]) for h in history)
    assert not torch.equal(value_head, trainer.critic.value_head.weight)  # the critic learned
    changed = [n for n, p in trainer.actor.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert changed
    saved = tmp_path / "run" / "checkpoints" / "step_2"
    assert (saved / "model" / "adapter_config.json").is_file() and (saved / "critic.pt").is_file()
    # resuming a LoRA run loads the adapter on the base model and carries on
    resumed = Trainer(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "algorithm.advantage=gae", "rollout.n=1",
                             "rollout.global_batch_completions=4", "train.total_steps=3", "train.eval_every=0",
                             "model.lora.rank=4", "train.resume=auto"))
    assert resumed.step_count == 2
    again = dict(resumed.actor.model.named_parameters())
    assert all(torch.equal(again[n], p) for n, p in trainer.actor.model.named_parameters() if p.requires_grad)


def test_sampled_eval_reports_pass_at_k(tmp_path, tiny_vlm_dir, shapes):
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=1", "train.eval_every=1",
                 "train.eval_n=3", "train.eval_temperature=1.0",
                 f"reward.functions=[{{name: '{REWARDS}:token_parity'}}]")
    history = run(cfg)[1]
    for h in history:
        assert h["eval/pass@3"] >= h["eval/accuracy"]  # a prompt with any correct sample counts for pass@k
        assert 0 < h["eval/pass@3"] <= 1  # token parity is right about half the time: some prompt passes


@pytest.mark.slow
def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    from vlrft.trainer import checkpoint

    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=3", "train.save_every=1",
                 "train.keep_last=2", "train.eval_every=0", "train.eval_before_training=false")
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if "step_3" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        run(cfg)
    names = sorted(p.name for p in checkpoint.list_checkpoints(tmp_path / "run"))
    assert names == ["step_1", "step_2"]  # keep_last pruned nothing it should not; step_3 never became visible
    assert checkpoint.resolve_resume("auto", tmp_path / "run").name == "step_2"
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "optimizer.pt").is_file()


@pytest.mark.slow
def test_keep_last_prunes_old_checkpoints(tmp_path, tiny_vlm_dir, shapes):
    from vlrft.trainer import checkpoint

    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=3", "train.save_every=1",
                 "train.keep_last=1", "train.eval_every=0", "train.eval_before_training=false")
    run(cfg)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == ["step_3"]


def test_wandb_without_the_package_says_which_extra(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "logging.wandb=true", "train.total_steps=1")
    with pytest.raises(UserError, match=r"pip install 'vlrft\[wandb\]'"):
        run(cfg)


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    """Real wandb, offline: the run and its resumption log to one wandb run, `vlrft-<run id>` (the lineage id every
    checkpoint keeps), where each start made a new run; WANDB_RUN_ID still names another."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'vlrft[wandb]')")
    from vlrft.trainer import checkpoint

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    common = ["logging.wandb=true", "train.save_every=1", "train.eval_every=0", "train.eval_before_training=false"]
    run(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, *common, "train.total_steps=2"))
    folder = tmp_path / "run"
    lineage = checkpoint.load_trainer_state(folder / "checkpoints" / "step_1")["run_id"]
    run(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, *common, "train.total_steps=3",
               f"train.resume={folder / 'checkpoints' / 'step_1'}"))
    runs = sorted(path.name for path in (folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-vlrft-{lineage}") for name in runs), runs
    monkeypatch.setenv("WANDB_RUN_ID", "chosen-by-the-user")
    run(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, *common, "train.total_steps=3", "train.overwrite=true"))
    assert [p.name for p in (folder / "wandb").glob("offline-run-*")][0].endswith("-chosen-by-the-user")


@pytest.mark.slow
def test_the_hf_engine_samples_under_the_trainers_mixed_precision(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    """On GPUs the trainer's forward runs under bf16 autocast over float32 weights and the reference is bf16; the hf
    engine samples under the same autocast, not in float32. VLRFT_CPU_MIXED_PRECISION=1 takes those paths on the
    CPU: every decode call of a training step ran its lean steps in bf16, the reference was loaded in bf16, and the
    step trained the float32 weights."""
    from vlrft.models.precision import CPU_MIXED_PRECISION_ENV
    from vlrft.decoding import lean

    monkeypatch.setenv(CPU_MIXED_PRECISION_ENV, "1")
    compute_dtypes = []
    init = lean.LeanDecoder.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        compute_dtypes.append(self.compute_dtype)

    monkeypatch.setattr(lean.LeanDecoder, "__init__", recorded)
    trainer = Trainer(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "model.dtype=bfloat16",
                             "algorithm.kl_coef=0.1", "train.total_steps=1", "train.eval_every=0"))
    assert {p.dtype for p in trainer.ref.parameters()} == {torch.bfloat16}
    before = {name: p.detach().clone() for name, p in trainer.actor.model.named_parameters()}
    metrics = trainer.train_step()
    assert compute_dtypes and set(compute_dtypes) == {torch.bfloat16}
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["kl"])
    after = dict(trainer.actor.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in before), "the step changed no weight"


@pytest.mark.slow
def test_evaluation_wakes_the_engine_like_a_rollout_and_puts_it_back_to_sleep(tmp_path, tiny_vlm_dir, shapes,
                                                                            monkeypatch):
    """A colocated engine (vLLM/SGLang) takes its GPU memory only between wake and sleep, beside the trainer's state
    offloaded by the strategy: evaluation samples inside that window too, and leaves the engine asleep for the
    training and checkpointing that follow (it used to wake it by sampling and leave it awake)."""
    import vlrft.trainer.trainer as trainer_module

    events = []

    class Recorder:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def wake(self):
            events.append("wake")

        def sleep(self):
            events.append("sleep")

        def generate(self, batch, sampling):
            events.append("generate")
            return self.engine.generate(batch, sampling)

    build = trainer_module.make_engine
    monkeypatch.setattr(trainer_module, "make_engine", lambda cfg, deps: Recorder(build(cfg, deps)))
    run(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=2", "train.eval_every=1",
               "train.eval_before_training=true"))
    awake = False
    for event in events:
        assert event != "generate" or awake, f"sampled while asleep: {events}"
        awake = {"wake": True, "sleep": False}.get(event, awake)
    assert events[-1] == "sleep" and events.count("wake") == events.count("sleep") == 5  # 2 rollouts, 3 evaluations


def _injected_out_of_memory(*args, **kwargs):
    # A CUDA out-of-memory error cannot happen on CPU: injected here, as torch raises it on a GPU.
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                                 "79.10 GiB of which 3.12 GiB is free.")


@pytest.mark.parametrize("phase", ["sampling", "forward", "optimizer", "evaluation", "reference", "wake", "sync"])
@pytest.mark.slow
def test_running_out_of_device_memory_names_the_phase_and_the_options_that_fit_it(
        tmp_path, tiny_vlm_dir, shapes, monkeypatch, capsys, phase):
    from vlrft.cli import main
    from vlrft.rollout.hf import HFEngine
    from vlrft.trainer.out_of_memory import OutOfMemory

    eval_before = "true" if phase == "evaluation" else "false"
    overrides = ["train.total_steps=1", "train.eval_every=0", f"train.eval_before_training={eval_before}",
                 f"train.output_dir={tmp_path / 'run'}"]
    if phase == "reference":
        overrides.append("algorithm.kl_coef=0.05")  # a reference model's logprobs come before the update
    cfg = config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, *overrides)
    if phase in ("sampling", "evaluation"):
        monkeypatch.setattr(HFEngine, "generate", _injected_out_of_memory)
    elif phase in ("forward", "reference"):
        monkeypatch.setattr(ActorVL, "logprobs", _injected_out_of_memory)
    elif phase == "wake":
        monkeypatch.setattr(HFEngine, "wake", _injected_out_of_memory)
    elif phase == "sync":
        monkeypatch.setattr(HFEngine, "update_weights", _injected_out_of_memory)
    else:
        monkeypatch.setattr(torch.optim.AdamW, "step", _injected_out_of_memory)
    with pytest.raises(OutOfMemory) as caught:
        run(cfg)
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert "Tried to allocate 20.00 GiB" in message and "train.resume=auto" in message and "vlrft plan" in message
    expected = {
        "sampling": ["step 1, sampling completions (rollout.engine=hf)", "rollout.global_batch_completions (now 16",
                     "rollout.max_new_tokens (now 5)", "rollout.engine=vllm"],
        "forward": ["step 1, training forward/backward of 8 completions (", "train.micro_batch_completions_per_rank "
                    "(now 8)", "train.max_tokens_per_micro_batch", "model.gradient_checkpointing=true",
                    "train.strategy=fsdp2", "model.lora.rank"],
        "optimizer": ["step 1, optimizer step", "train.strategy=fsdp2"],
        "evaluation": ["step 0, evaluation", "train.eval_batch_prompts (now 8", "rollout.max_new_tokens (now 5)"],
        "reference": ["step 1, old/reference logprobs and values", "train.micro_batch_completions_per_rank (now 8)"],
        "wake": ["step 1, handing the GPU between the trainer's state and the engine (rollout.engine=hf)",
                 "rollout.global_batch_completions (now 16"],
        "sync": ["step 1, weight sync to the engine", "rollout.weight_sync_bucket_mb (now 512)"],
    }[phase]
    for part in expected:
        assert part in message, (part, message)
    if phase != "sampling":
        return
    # The CLI prints it as one line and exits 2, as any other error the user can fix.
    from vlrft.config import save_config

    config_file = save_config(config(tmp_path / "cli", tiny_vlm_dir("qwen2_vl"), shapes, *overrides[:3]),
                              tmp_path / "cli")
    capsys.readouterr()
    assert main(["train", str(config_file)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the loading bars
    assert len(errors) == 1 and errors[0].startswith("vlrft train: error: step 1, sampling") and \
        "ran out of memory" in errors[0], errors


def test_reward_functions_are_prepared_before_the_first_step(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    """A reward model loads when the trainer starts, not inside the first step's reward.timeout_s."""
    from vlrft.rewards import RewardSet

    calls = []
    monkeypatch.setattr(RewardSet, "prepare", lambda self: calls.append("prepare"))
    score = RewardSet.score
    monkeypatch.setattr(RewardSet, "score", lambda self, *a, **k: calls.append("score") or score(self, *a, **k))
    trainer = Trainer(config(tmp_path, tiny_vlm_dir("qwen2_vl"), shapes, "train.total_steps=1", "train.eval_every=0",
                             "train.eval_before_training=false"))
    assert calls == ["prepare"]
    trainer.fit()
    assert calls[0] == "prepare" and calls.count("prepare") == 1 and "score" in calls


@pytest.mark.parametrize("epochs", [1, 2], ids=["on-policy", "old-policy-pass"])
@pytest.mark.slow
def test_on_policy_tis_weights_are_one_with_top_p_below_one(tmp_path, tiny_vlm_dir, shapes, epochs):
    """The engines report logprobs of the top-p truncated distribution they sampled from; the trainer compares them
    with its own on the same scale (the kept mass added back), so a rollout of the current policy weighs 1."""
    cfg = config(tmp_path, tiny_vlm_dir(), shapes, "algorithm.tis_cap=2.0", "rollout.top_p=0.6",
                 "rollout.temperature=0.8", f"train.ppo_epochs={epochs}", "train.eval_every=0")
    _, history = run(cfg)
    weights = [m["actor/tis_weight_mean"] for m in history if "actor/tis_weight_mean" in m]
    assert len(weights) == 2 and all(abs(w - 1.0) < 1e-4 for w in weights), weights


@pytest.mark.slow
@pytest.mark.parametrize("arch,model_class", [("glm4v", "Glm4vForConditionalGeneration"),
                                              ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
                                              ("gemma3", "Gemma3ForConditionalGeneration"),
                                              ("internvl", "InternVLForConditionalGeneration"),
                                              ("llava_onevision", "LlavaOnevisionForConditionalGeneration"),
                                              ("smolvlm", "SmolVLMForConditionalGeneration")])
def test_vlrft_train_runs_three_grpo_steps(arch, model_class, tmp_path, tiny_vlm_dir, shapes):
    """`vlrft train` end to end on a tiny GLM-4.1V, Qwen3-VL-MoE, Gemma 3, InternVL 3, LLaVA-OneVision and SmolVLM:
    three GRPO steps through the CLI (hf engine, the shared-prompt forward or full rows, AdamW), metrics for each, the
    weights moved (the MoE's experts and routers too), and a final checkpoint transformers loads as the same family."""
    from transformers import AutoModelForImageTextToText

    from vlrft.cli import main

    folder = tiny_vlm_dir(arch)
    overrides = [f"model.path={folder}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
                 "data.min_pixels=784", "data.max_pixels=3136", "algorithm.advantage=grpo", "rollout.n=4",
                 "rollout.global_batch_completions=16", "rollout.max_new_tokens=5",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={tmp_path / 'run'}",
                 "train.total_steps=3", "train.lr=1e-2", "train.micro_batch_completions_per_rank=8",
                 "train.eval_every=0", "train.save_every=3", "logging.progress=false"]
    config_file = tmp_path / f"{arch}.yaml"
    config_file.write_text("{}\n")  # everything is in the overrides
    assert main(["train", str(config_file), *overrides]) == 0
    out = tmp_path / "run"
    metrics = [m for m in read_metrics(out) if "reward/mean" in m]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["entropy"]) and m["completions/mean_length"] <= 5 for m in metrics)
    trained = AutoModelForImageTextToText.from_pretrained(out / "checkpoints" / "step_3" / "model")
    start = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(trained).__name__ == model_class
    moved = [k for k, v in start.state_dict().items() if not torch.equal(v, trained.state_dict()[k])]
    assert any(k.startswith("lm_head") for k in moved)
    assert any(".language_model.layers" in k or ".text_model.layers" in k for k in moved)  # SmolVLM: text_model
    assert any(k.startswith(("model.visual.", "model.vision_tower.", "model.vision_model.")) for k in moved)
    if arch == "qwen3_vl_moe":  # experts (3-D tensors, not linear layers) and routers train like any weight
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in moved)
        assert any(k.endswith("mlp.gate.weight") for k in moved)


@pytest.mark.slow
def test_vlrft_train_with_lora_on_qwen3_vl_moe_experts(tmp_path, tiny_vlm_dir, shapes):
    """LoRA on a tiny Qwen3-VL-MoE's attention and experts through `vlrft train`: two GRPO steps; only adapters
    train, those on the experts too (PEFT's target_parameters), and the step-2 adapter loads merged into its base."""
    from vlrft.cli import main
    from vlrft.models.loading import load_policy

    folder = tiny_vlm_dir("qwen3_vl_moe")
    overrides = [f"model.path={folder}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
                 "data.min_pixels=784", "data.max_pixels=3136", "algorithm.advantage=grpo", "rollout.n=4",
                 "rollout.global_batch_completions=16", "rollout.max_new_tokens=5", "model.lora.rank=4",
                 "model.lora.target_modules=[q_proj,v_proj,experts.gate_up_proj,experts.down_proj]",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={tmp_path / 'run'}",
                 "train.total_steps=2", "train.lr=1e-2", "train.micro_batch_completions_per_rank=8",
                 "train.eval_every=0", "train.save_every=2", "logging.progress=false"]
    config_file = tmp_path / "moe_lora.yaml"
    config_file.write_text("{}\n")
    assert main(["train", str(config_file), *overrides]) == 0
    metrics = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["entropy"]) for m in metrics)
    adapter = tmp_path / "run" / "checkpoints" / "step_2" / "model"
    from safetensors.torch import load_file

    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(".mlp.experts." in k for k in saved) and any("q_proj" in k for k in saved)
    merged, base = load_policy(adapter), load_policy(folder)
    expert = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(merged.state_dict()[expert], base.state_dict()[expert])  # the experts' adapters trained
    router = "model.language_model.layers.0.mlp.gate.weight"
    assert torch.equal(merged.state_dict()[router], base.state_dict()[router])  # routers stay frozen under LoRA

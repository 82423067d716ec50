"""Nothing lost: one run per output folder, lineage-only pruning, Ctrl-C that saves, crash leftovers repaired."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from vlrft.config import load_config
from vlrft.errors import ConfigError, UserError
from vlrft.logging import read_metrics
from vlrft.trainer import Trainer
from vlrft.trainer import checkpoint as ckpt
from vlrft.trainer import manifest
from vlrft.trainer.interrupt import TrainingInterrupted

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=16, test_size=4))


def config(out, model_dir, shapes, *overrides):
    base = [
        f"model.path={model_dir}", "model.dtype=float32",
        f"data.train_files=[{shapes['train']}]", "data.min_pixels=784", "data.max_pixels=3136",
        "rollout.n=4", "rollout.global_batch_completions=8", "rollout.max_new_tokens=4",
        f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
        f"train.output_dir={out}", "train.total_steps=2", "train.lr=1e-3", "train.micro_batch_completions_per_rank=8",
        "train.save_every=1", "logging.progress=false", "logging.completions_every=0",
    ]
    return load_config(None, base + list(overrides))


def fit(cfg):
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer


def steps(out):
    return [m["step"] for m in read_metrics(out)]


def test_a_second_run_into_a_used_folder_is_refused_and_touches_nothing(tmp_path, tiny_vlm_dir, shapes):
    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(UserError, match=r"not empty .*train.resume=auto.*train.overwrite=true"):
        Trainer(config(out, tiny_vlm_dir(), shapes))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert steps(out) == [1, 2]


def test_overwrite_clears_only_the_run_files(tmp_path, tiny_vlm_dir, shapes):
    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=3"))
    (out / "notes.txt").write_text("mine")
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=1", "train.overwrite=true"))
    assert steps(out) == [1]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_1"]
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="contradict"):
        Trainer(config(out, tiny_vlm_dir(), shapes, "train.overwrite=true", "train.resume=auto"))


def test_keep_last_prunes_only_the_current_run_lineage(tmp_path, tiny_vlm_dir, shapes):
    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes, "train.keep_last=10"))
    # A checkpoint of another run (a later step number) sits in the same folder.
    foreign = out / "checkpoints" / "step_7"
    os.replace(out / "checkpoints" / "step_2", foreign)
    state = json.loads((foreign / "trainer_state.json").read_text())
    (foreign / "trainer_state.json").write_text(json.dumps({**state, "step": 7, "run_id": "another-run"}))
    own = out / "checkpoints" / "step_1"
    trainer = fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=3", "train.keep_last=1",
                         f"train.resume={own}"))
    assert trainer.run_id == state["run_id"]  # a resumed run continues its lineage
    assert sorted(p.name for p in ckpt.list_checkpoints(out)) == ["step_3", "step_7"]


def _signal_during(monkeypatch, target, attr, when):
    """Send this process SIGINT when `target.attr` is called and `when(args)` holds."""
    real = getattr(target, attr)

    def wrapped(*args, **kwargs):
        if when(*args):
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, attr, wrapped)


@pytest.mark.slow
def test_ctrl_c_mid_step_finishes_the_step_saves_and_resumes(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    out = tmp_path / "run"
    from vlrft.trainer import trainer as trainer_module

    calls = []
    _signal_during(monkeypatch, trainer_module, "make_experience", lambda *a: calls.append(1) or len(calls) == 2)
    with pytest.raises(TrainingInterrupted, match="stopped at step 2; checkpoint saved"):
        fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=0"))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_2"]
    monkeypatch.undo()
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=0", "train.resume=auto"))
    assert steps(out) == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigterm_mid_step_saves_that_step_exits_143_and_the_run_resumes(tmp_path, tiny_vlm_dir, shapes):
    """A scheduler's preemption notice to a real `vlrft train` process: the step finishes, is saved, exit 128 + 15."""
    import subprocess
    import sys

    import yaml

    from vlrft.config import to_dict

    out = tmp_path / "run"
    cfg = config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=0",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash_then_sigterm_in_step_2'}}]")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    command = [sys.executable, "-m", "vlrft", "train", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "SIGTERM: stopping after this step and saving" in done.stderr
    assert "stopped at step 2; checkpoint saved" in done.stderr
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_2"] and steps(out) == [1, 2]
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=0", "train.resume=auto"))
    assert steps(out) == [1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_during_a_checkpoint_write_completes_it(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    out = tmp_path / "run"
    _signal_during(monkeypatch, ckpt.torch, "save", lambda obj, path, *a: str(path).endswith("optimizer.pt"))
    with pytest.raises(KeyboardInterrupt):
        fit(config(out, tiny_vlm_dir(), shapes, "train.save_on_interrupt=false"))
    step_1 = out / "checkpoints" / "step_1"
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_1"]
    assert (step_1 / "optimizer.pt").is_file() and (step_1 / "scheduler.pt").is_file()
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_ctrl_c_during_a_checkpoint_write_with_save_on_interrupt_stops_after_it(tmp_path, tiny_vlm_dir, shapes,
                                                                                monkeypatch):
    out = tmp_path / "run"
    _signal_during(monkeypatch, ckpt.torch, "save", lambda obj, path, *a: str(path).endswith("step_2/optimizer.pt"))
    with pytest.raises(TrainingInterrupted, match="stopped at step 2"):
        fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4"))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_1", "step_2"] and steps(out) == [1, 2]


def test_ctrl_c_without_save_on_interrupt_stops_at_once(tmp_path, tiny_vlm_dir, shapes, monkeypatch):
    out = tmp_path / "run"
    from vlrft.trainer import trainer as trainer_module

    _signal_during(monkeypatch, trainer_module, "make_experience", lambda *a: True)
    with pytest.raises(KeyboardInterrupt) as info:
        fit(config(out, tiny_vlm_dir(), shapes, "train.save_on_interrupt=false"))
    assert not isinstance(info.value, TrainingInterrupted)
    assert ckpt.list_checkpoints(out) == [] and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_torn_metrics_line_and_a_restart_from_scratch_duplicate_nothing(tmp_path, tiny_vlm_dir, shapes,
                                                                          monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    real_step = Trainer.train_step

    def crash_at_step_3(self):
        if self.step_count == 2:
            raise RuntimeError("power cut")
        return real_step(self)

    # A crash before the first checkpoint: steps 1-2 are logged, nothing is saved.
    monkeypatch.setattr(Trainer, "train_step", crash_at_step_3)
    with pytest.raises(RuntimeError, match="power cut"):
        fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=3", "train.save_every=0"))
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # torn by the crash
    monkeypatch.setattr(Trainer, "train_step", real_step)
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=3", "train.save_every=0", "train.resume=auto"))
    assert steps(out) == [1, 2, 3]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]

    # A resume from a checkpoint after a torn line: the line is dropped, steps after the checkpoint rewritten.
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=0", "train.resume=auto"))
    assert steps(out) == [1, 2, 3, 4]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert torch.isfinite(torch.tensor([m["reward/mean"] for m in read_metrics(out)])).all()


def test_a_step_that_makes_the_weights_non_finite_stops_the_run_unsaved(tmp_path, tiny_vlm_dir, shapes):
    from vlrft.trainer.update import parameters_finite

    assert parameters_finite([torch.zeros(2), torch.ones(3)]) and not parameters_finite([torch.tensor([1.0, math.inf])])
    assert parameters_finite([]) and parameters_finite([torch.zeros(0)])  # nothing on this rank: nothing diverged
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    assert parameters_finite([bf16, torch.ones(3)]) and not parameters_finite([bf16, torch.tensor([math.nan, 1.0])])
    assert not parameters_finite([torch.ones(3), torch.tensor([-math.inf]).to(torch.bfloat16)])
    huge = torch.tensor([3e38, -3e38])  # finite, though its L2 norm overflows
    assert parameters_finite([huge]) and not parameters_finite([huge, torch.tensor([math.nan])])
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"step 1: the optimizer step made the weights non-finite .*train.lr"):
        fit(config(out, tiny_vlm_dir(), shapes, "train.lr=1e39", "train.total_steps=1"))
    assert ckpt.list_checkpoints(out) == []


def test_a_finite_divergence_stops_the_run_and_leaves_the_last_good_checkpoint(tmp_path, tiny_vlm_dir, shapes):
    """train.lr=1e30: step 1 moved the weights to ~1e30, all finite, so they were saved; step 2's logits were NaN and
    sampling died in an IndexError (index 512 out of bounds, vlrft/decoding). A step that changes the norm of the
    trained weights by more than half of it is divergence: stopped before the save, the last good checkpoint stays
    the one train.resume=auto takes."""
    from vlrft.errors import DivergedError
    from vlrft.trainer.update import MAX_NORM_CHANGE, weights_norm_sq

    assert MAX_NORM_CHANGE == 0.5
    assert float(weights_norm_sq([torch.full((4,), 2.0), torch.ones(0)])) == 16.0
    assert not math.isfinite(float(weights_norm_sq([torch.full((4,), 1e30)])))  # float32 norm overflows: diverged
    fresh = tmp_path / "fresh"
    with pytest.raises(DivergedError, match=r"step 1: the optimizer step changed the norm of the trained weights "
                                            r"from [\d.e+]+ to a norm float32 cannot hold \(weights past ~1e19; at most 1.5 "
                                            r"times is allowed in one step\): training diverged.*train.lr \(now "
                                            r"1e\+30\)"):
        fit(config(fresh, tiny_vlm_dir(), shapes, "train.lr=1e30"))
    assert ckpt.list_checkpoints(fresh) == []
    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=1"))  # step 1, at a sane lr: the good checkpoint
    resumed = Trainer(config(out, tiny_vlm_dir(), shapes, "train.resume=auto"))
    for group in resumed.optimizer.param_groups:  # step 2's learning rate explodes
        group["lr"] = 1e30
    with pytest.raises(DivergedError, match=r"step 2: the optimizer step changed the norm"):
        resumed.fit()
    assert [c.name for c in ckpt.list_checkpoints(out)] == ["step_1"]
    assert ckpt.resolve_resume("auto", out).name == "step_1"
    # a sane lr keeps every step well inside the bound (the tests' lr=1e-3 on tiny models)
    fit(config(out, tiny_vlm_dir(), shapes, "train.resume=auto"))
    assert [c.name for c in ckpt.list_checkpoints(out)] == ["step_1", "step_2"]


def test_sampling_from_diverged_weights_is_refused_before_any_out_of_range_id_is_used(tiny_vlm_dir):
    """NaN logits make the inverse-CDF sampler answer the vocabulary size; that id must never reach an index
    operation (the gather of its logprob, the history, the next step's embedding)."""
    from vlrft.errors import DivergedError
    from vlrft.models.loading import load_policy
    from vlrft.rollout.base import SamplingParams
    from vlrft.decoding import decode_groups
    from vlrft.vision import VisualBatch

    model = load_policy(tiny_vlm_dir()).eval()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("inf"))  # inf * 0 somewhere: NaN logits
    sampling = SamplingParams(n=2, max_new_tokens=3, temperature=1.0)
    for greedy in (False, True):
        params = SamplingParams(n=2, max_new_tokens=3, temperature=0.0) if greedy else sampling
        with pytest.raises(DivergedError, match=r"sampling: the policy's next-token distribution is not finite"):
            with torch.no_grad():
                decode_groups(model, [[1, 2, 3]], VisualBatch.empty(1, 2), params, pad_id=0, stop_ids={5},
                              image_token_id=-1, video_token_id=-1)


def test_a_full_disk_during_a_save_says_so_naming_the_folder_and_the_size(tmp_path, tiny_vlm_dir, shapes,
                                                                           monkeypatch):
    """torch.save on a full disk fails with "[enforce fail at inline_container.cc] . unexpected pos N vs M" (its
    stream writer drops the errno). The run stops with one line: the disk is full, which folder, how much a
    checkpoint needs and how much is free; the half-written step is removed, the previous checkpoint kept."""
    import collections
    import shutil

    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=1"))
    size = sum(p.stat().st_size for p in (out / "checkpoints" / "step_1").rglob("*") if p.is_file())
    real_save = torch.save

    def save_on_a_full_disk(obj, path, *args, **kwargs):  # a mock: a full disk cannot be made here
        if str(path).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4480 vs 4374")
        return real_save(obj, path, *args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))  # a mock: full
    with pytest.raises(UserError) as err:
        fit(config(out, tiny_vlm_dir(), shapes, "train.resume=auto"))
    message = str(err.value)
    assert message.startswith(f"checkpoint step 2: the disk is full while writing into '{out / 'checkpoints'}' "
                              "([enforce fail at inline_container.cc:626] . unexpected pos 4480 vs 4374); the "
                              "checkpoint needs about "), message
    assert f"needs about {size / 1e6:.1f} MB (the size of step_1)" in message, (size, message)
    assert "the size of step_1), 0.0 MB free there" in message and "train.resume=auto" in message
    assert "\n" not in message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]  # no half-written .tmp-step_2
    monkeypatch.setattr(ckpt.shutil, "disk_usage", shutil.disk_usage)
    monkeypatch.setattr(torch, "save", real_save)
    enospc = OSError(28, "No space left on device")
    assert ckpt.write_failure(enospc) and ckpt.write_failure(RuntimeError("unexpected pos 1 vs 2"))
    assert not ckpt.write_failure(RuntimeError("CUDA error")) and not ckpt.write_failure(OSError(2, "missing"))


def test_a_kill_during_the_last_prune_leaves_nothing_behind_after_resume(tmp_path, tiny_vlm_dir, shapes):
    """Pruning renames a checkpoint to `.deleting-*` before removing it; a kill in between, with no later
    save to finish the job (the run had reached its last step), must not leave that folder forever."""
    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes))
    root = out / "checkpoints"
    half_deleted = root / ".deleting-step_1"
    (half_deleted / "model").mkdir(parents=True)  # what the kill left: a renamed, partly removed checkpoint
    trainer = Trainer(config(out, tiny_vlm_dir(), shapes, "train.resume=auto"))
    assert trainer.resume_from == root / "step_2"
    assert not half_deleted.exists()


def test_tensorboard_shows_every_kept_step_once_whatever_order_event_files_sort_in(tmp_path):
    """Killed runs leave event files whose names sort by the second and pid they were made in, so a resumed run's
    file can be read before an older one (found by the fault test in CI: steps 4-5 vanished). Every (re)start
    rewrites one event file from the jsonl logs: TensorBoard shows exactly the steps metrics.jsonl keeps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vlrft.config import load_config
    from vlrft.logging import CompletionRow, RunLogger

    cfg = load_config(None, ["logging.progress=false"])
    out = tmp_path / "run"
    first = RunLogger(cfg, out, total_steps=6)
    for step in range(1, 6):
        first.log(step, {"reward/mean": float(step)})
    first.log_completions(2, [CompletionRow(prompt="p", completion="c", rewards={"r": 1.0}, advantage=0.5)])
    first.close()  # killed after step 5; the checkpoint is step 3
    (old,) = (out / "tensorboard").glob("events.out.tfevents.*")
    old.rename(old.with_name("events.out.tfevents.9999999999.host.1.0"))  # sorts after any newer file
    resumed = RunLogger(cfg, out, total_steps=6, start_step=3)
    for step in (4, 5, 6):
        resumed.log(step, {"reward/mean": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50),
                                                                          (6, 60)]
    assert [e.step for e in events.Tensors("completions/text_summary")] == [2]


@pytest.mark.slow
def test_a_run_resumed_from_an_older_checkpoint_keeps_its_own_newest_and_auto_resumes_it(tmp_path, tiny_vlm_dir,
                                                                                       shapes):
    """Resuming from step 2 of a run that went on to step 6 writes a new step 4: keep-last and resume=auto take the
    checkpoints in the order they were written, so the new step 4 is the newest, not the abandoned step 6."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=6", "train.save_every=2", "train.keep_last=3"))
    abandoned = {p.name: ckpt.load_trainer_state(p)["saved_at"] for p in ckpt.list_checkpoints(out)}
    assert sorted(abandoned) == ["step_2", "step_4", "step_6"]
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=4", "train.save_every=2", "train.keep_last=2",
               f"train.resume={root / 'step_2'}", "train.lr=1e-4"))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_6", "step_4"]  # in the order written
    assert ckpt.load_trainer_state(root / "step_4")["saved_at"] > abandoned["step_6"]  # the resumed run's
    assert ckpt.resolve_resume("auto", out) == root / "step_4"
    fit(config(out, tiny_vlm_dir(), shapes, "train.total_steps=6", "train.save_every=2", "train.keep_last=1",
               "train.resume=auto"))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_6"]
    assert ckpt.load_trainer_state(root / "step_6")["saved_at"] > abandoned["step_6"]
    assert steps(out) == [1, 2, 3, 4, 5, 6]


def test_what_a_crash_leaves_in_the_checkpoint_folder_is_cleared_on_resume(tmp_path, tiny_vlm_dir, shapes):
    """A SIGKILL mid-save leaves `.tmp-step_k` (a whole checkpoint's size), mid-replace `.old-step_k`: both are
    cleared. Killed between a same-step save's two renames (which start once the new save is complete and synced),
    the new checkpoint takes its place; with no complete new one there, the old one goes back."""
    import shutil

    out = tmp_path / "run"
    fit(config(out, tiny_vlm_dir(), shapes, "train.keep_last=2"))
    root = out / "checkpoints"
    (root / ".tmp-step_3" / "sharded").mkdir(parents=True)  # a save killed half-way
    shutil.copytree(root / "step_2", root / ".tmp-step_2")  # the new save of step 2, complete
    state = ckpt.load_trainer_state(root / ".tmp-step_2")
    (root / ".tmp-step_2" / ckpt.STATE_FILE).write_text(json.dumps({**state, "saved_at": state["saved_at"] + 1}))
    manifest.reseal(root / ".tmp-step_2")  # edited on purpose: a whole new save
    os.replace(root / "step_2", root / ".old-step_2")  # killed between its two renames
    (root / ".old-step_1").mkdir()  # killed after them, before the old copy was removed
    (root / ".old-step_1" / "model").mkdir()
    trainer = Trainer(config(out, tiny_vlm_dir(), shapes, "train.resume=auto"))
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    assert trainer.resume_from == root / "step_2"
    assert ckpt.load_trainer_state(root / "step_2")["saved_at"] == state["saved_at"] + 1  # the new one
    # no complete new save: the old checkpoint goes back
    os.replace(root / "step_2", root / ".old-step_2")
    (root / ".tmp-step_2" / "model").mkdir(parents=True)  # the new save, killed half-way
    ckpt.clear_crash_leftovers(out)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    assert ckpt.load_trainer_state(root / "step_2")["saved_at"] == state["saved_at"] + 1


def test_checkpoints_of_earlier_versions_without_saved_at_come_first_by_step(tmp_path):
    """A checkpoint written before `saved_at` existed sorts by step, before every checkpoint that has one (its
    files' times are no guide: a copy changes them)."""
    root = tmp_path / "checkpoints"
    for step, saved_at in ((6, None), (4, None), (2, 100.0)):
        (root / f"step_{step}").mkdir(parents=True)
        state = {"step": step, "run_id": "r"} | ({"saved_at": saved_at} if saved_at else {})
        (root / f"step_{step}" / ckpt.STATE_FILE).write_text(json.dumps(state))
    os.utime(root / "step_4" / ckpt.STATE_FILE, (2e9, 2e9))  # copied later than step 6
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_4", "step_6", "step_2"]


def test_a_resume_from_another_base_model_is_refused_and_a_copy_of_the_same_one_is_not(tmp_path, tiny_vlm_dir, shapes):
    """A resume reads frozen weights (a LoRA base, a frozen vision tower), the reference and, under FSDP2/DeepSpeed,
    its starting point from model.path: other weights there would train on silently. A copy of the base elsewhere
    (same files) is the same base."""
    import shutil

    out = tmp_path / "run"
    base = tiny_vlm_dir()
    fit(config(out, base, shapes, "train.total_steps=1"))
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    from safetensors.torch import load_file, save_file

    weights = {name: t + 0.01 for name, t in load_file(other / "model.safetensors").items()}  # another fine-tune
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"trained from another base model than model.path=.*other"):
        Trainer(config(out, other, shapes, "train.total_steps=2", "train.resume=auto"))
    fit(config(out, copy, shapes, "train.total_steps=2", "train.resume=auto"))
    assert steps(out) == [1, 2]


def test_the_run_folder_hold_refuses_a_live_owner_and_takes_over_a_stale_one(tmp_path, capsys):
    """One live run per output folder: `<output_dir>/.vlrft-run.lock` names the holder (host, pid, process start,
    heartbeat). A live holder is refused with its host and pid; a dead one's hold is taken over with a message: on
    this host by its pid, on another host (a shared file system) by a heartbeat older than STALE_AFTER_S."""
    import socket
    import subprocess
    import sys
    import time

    from vlrft.trainer import run_folder
    from vlrft.trainer.run_folder import HOLD_FILE, RunHold

    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / HOLD_FILE
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = run_folder._process_start(live.pid)
        lock.write_text(json.dumps({"host": host, "pid": live.pid, "process_start": started, "started": time.time(),
                                    "heartbeat": time.time() - 3600, "token": "other"}))
        with pytest.raises(UserError, match=rf"train.output_dir='{folder}' is in use by a live run: pid {live.pid} on "
                                            rf"host {host}, started .* \(its process is alive\)"):
            RunHold(folder).acquire()
        # the same pid, but another process (the pid reused after the holder died): stale
        lock.write_text(json.dumps({"host": host, "pid": live.pid, "process_start": "1", "started": time.time()}))
        messages = []
        hold = RunHold(folder, messages.append)
        hold.acquire()
        assert messages and f"took over the hold of a run that is gone (pid {live.pid} on host {host}" in messages[0]
        hold.release()
        assert not lock.exists()
        # the holder ended but its parent has not reaped it yet (a zombie, as workers whose launcher was killed
        # are until init reaps them): gone, not live
        lock.write_text(json.dumps({"host": host, "pid": live.pid, "process_start": started, "started": 0,
                                    "heartbeat": time.time(), "token": "zombie"}))
        live.kill()
        deadline = time.time() + 10
        while run_folder._process_state(live.pid) != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert run_folder._process_state(live.pid) == "Z"
        messages = []
        RunHold(folder, messages.append).acquire()
        assert f"took over the hold of a run that is gone (pid {live.pid} on host {host}" in messages[0]
    finally:
        live.kill()
        live.wait()
    # a dead pid on this host: stale at once, whatever its heartbeat
    lock.write_text(json.dumps({"host": host, "pid": live.pid, "process_start": started, "started": 0,
                                "heartbeat": time.time(), "token": "dead"}))
    messages = []
    hold = RunHold(folder, messages.append)
    hold.acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid() and "took over" in messages[0]
    hold.acquire()  # this process taking its own hold again (a resumed Trainer in the same process): allowed
    hold.release()
    # another host: judged by the heartbeat
    lock.write_text(json.dumps({"host": "node-7", "pid": 1234, "started": time.time(), "heartbeat": time.time() - 5}))
    with pytest.raises(UserError, match=r"pid 1234 on host node-7, .*\(its heartbeat is \d+ s old \(a hold is stale "
                                        r"after 600 s without one, VLRFT_HOLD_STALE_S\)\)"):
        RunHold(folder).acquire()
    lock.write_text(json.dumps({"host": "node-7", "pid": 1234, "started": 0, "heartbeat": time.time() - 601}))
    messages = []
    RunHold(folder, messages.append).acquire()
    assert "took over the hold of a run that is gone (pid 1234 on host node-7" in messages[0]


def test_a_second_train_into_a_folder_a_live_run_holds_is_refused(tmp_path, tiny_vlm_dir, shapes):
    """The hold is taken before the folder is read or cleared; the refused run writes nothing there. A run refused
    before it wrote anything leaves no folder behind."""
    import socket

    from vlrft.trainer.run_folder import HOLD_FILE

    out = tmp_path / "run"
    trainer = Trainer(config(out, tiny_vlm_dir(), shapes))
    holder = json.loads((out / HOLD_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    other = tmp_path / "other"
    other.mkdir()
    (other / HOLD_FILE).write_text(json.dumps({"host": "node-3", "pid": 99, "started": 0, "heartbeat": 4e9}))
    before = sorted(p.name for p in other.iterdir())
    with pytest.raises(UserError, match=r"is in use by a live run: pid 99 on host node-3"):
        Trainer(config(other, tiny_vlm_dir(), shapes, "train.overwrite=true"))
    assert sorted(p.name for p in other.iterdir()) == before
    trainer.fit()
    assert not (out / HOLD_FILE).exists()  # given back at the end
    bad = tmp_path / "never" / "made"
    with pytest.raises(ConfigError):
        Trainer(config(bad, tiny_vlm_dir(), shapes, "reward.functions=[{name: nosuch}]"))
    with pytest.raises(UserError, match="not found"):  # refused after the hold was taken
        Trainer(config(bad, tiny_vlm_dir(), {"train": tmp_path / "missing.jsonl"}))
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("folder, says", [
    ("/dev/null", r"is a file or device, not a folder"),
    ("/dev/null/run", r"has a file or device in its path \(/dev/null\)"),
    ("/proc/self/run", r"is inside /proc, a system file system"),
    ("/sys/vlrft-run", r"is inside /sys, a system file system"),
])
def test_an_output_dir_that_cannot_be_a_folder_is_one_line_naming_the_setting(folder, says):
    from vlrft.trainer.run_folder import RunHold

    with pytest.raises(UserError, match=rf"^train.output_dir='{folder}' {says}.*set train.output_dir to a folder on a "
                                        r"writable disk"):
        RunHold(folder).acquire()


def test_a_read_only_output_dir_is_one_line_naming_the_setting(tmp_path, monkeypatch):
    """A read-only mount (EROFS, errno 30) is simulated: root, which runs the tests here, writes through chmod 0o555."""
    import errno

    from vlrft.trainer import run_folder

    folder = tmp_path / "ro" / "run"

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(run_folder.Path, "mkdir", read_only)
    with pytest.raises(UserError, match=rf"train.output_dir='{folder}' is on a read-only file system; set "
                                        "train.output_dir to a folder on a writable disk"):
        run_folder.RunHold(folder).acquire()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 0o555 folder (read-only case: the EROFS test)")
def test_an_output_dir_without_write_permission_is_one_line_naming_the_setting(tmp_path):
    from vlrft.trainer.run_folder import RunHold

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(UserError, match=rf"train.output_dir='{locked / 'run'}' cannot be written: permission "
                                            "denied"):
            RunHold(locked / "run").acquire()
    finally:
        locked.chmod(0o755)


def test_vlrft_train_into_dev_null_prints_one_line(tmp_path, tiny_vlm_dir, shapes, capsys):
    from vlrft.cli import main

    (tmp_path / "run.yaml").write_text("{}\n")
    model = tiny_vlm_dir()
    capsys.readouterr()  # the fixture's own progress bars
    overrides = [f"model.path={model}", f"data.train_files=[{shapes['train']}]", "rollout.n=4",
                 "rollout.global_batch_completions=8", f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
                 "train.output_dir=/dev/null"]
    assert main(["train", str(tmp_path / "run.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("vlrft train: error: train.output_dir='/dev/null' is a file or device, not a folder; set "
                           "train.output_dir to a folder on a writable disk (e.g. train.output_dir=runs/my-run)")

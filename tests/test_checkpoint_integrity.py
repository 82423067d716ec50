"""A checkpoint is resumed only whole and only as data: planted pickles are refused unrun, damaged files named.

Every case is one `UserError` line naming the file (the CLI prints it as one line, exit 2), never a traceback, a
silent resume from another checkpoint, or code from the checkpoint run."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from vlrft.cli import main
from vlrft.config import load_config
from vlrft.errors import UserError
from vlrft.trainer import Trainer
from vlrft.trainer import checkpoint as ckpt
from vlrft.trainer import manifest

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


class Payload:
    """Unpickling this creates `marker`: what a planted checkpoint file would do (any command could run there)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=16, test_size=4))


def overrides(out, model_dir, shapes, *more):
    return [f"model.path={model_dir}", "model.dtype=float32",
            f"data.train_files=[{shapes['train']}]", "data.min_pixels=784", "data.max_pixels=3136",
            "rollout.n=4", "rollout.global_batch_completions=8", "rollout.max_new_tokens=4",
            f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
            f"train.output_dir={out}", "train.total_steps=2", "train.lr=1e-3",
            "train.micro_batch_completions_per_rank=8", "train.save_every=1", "logging.progress=false",
            "logging.completions_every=0", *more]


def config(out, model_dir, shapes, *more):
    return load_config(None, overrides(out, model_dir, shapes, *more))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_vlm_dir, shapes):
    """A two-step run with checkpoints step_1 and step_2, written once; each test works on a copy."""
    out = tmp_path_factory.mktemp("finished") / "run"
    Trainer(config(out, tiny_vlm_dir(), shapes)).fit()
    return out


@pytest.fixture
def run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def resume(out, tiny_vlm_dir, shapes, *more):
    return Trainer(config(out, tiny_vlm_dir(), shapes, "train.total_steps=3", "train.resume=auto", *more))


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_every_save_writes_a_manifest_last_that_lists_every_file(run):
    step = run / "checkpoints" / "step_2"
    listed = json.loads((step / manifest.MANIFEST).read_text())
    assert set(listed["files"]) == set(manifest.files_in(step)) >= {"optimizer.pt", "scheduler.pt", "rng/rank0.pt",
                                                                     "trainer_state.json", "model/model.safetensors"}
    assert listed["saved_at"] == ckpt.load_trainer_state(step)["saved_at"]
    assert manifest.verify(step) is None


# ------------------------------------------------------------------ planted pickles

@pytest.mark.parametrize("name", ["scheduler.pt", "optimizer.pt", "rng/rank0.pt"])
def test_a_planted_pickle_in_a_checkpoint_is_refused_by_name_and_never_runs(run, tiny_vlm_dir, shapes, tmp_path,
                                                                            name):
    marker = tmp_path / "payload-ran"
    step = run / "checkpoints" / "step_2"
    torch.save({"state": Payload(marker)}, step / name)
    manifest.reseal(step)  # whoever planted it could rewrite the manifest too
    with pytest.raises(UserError) as excinfo:
        resume(run, tiny_vlm_dir, shapes).fit()
    message = one_line_error(excinfo)
    assert str(step / name) in message and "open, which only code" in message and "nothing in it was run" in message
    assert not marker.exists()


def test_checkpoint_files_of_the_numpy_rng_and_the_optimizer_still_load_as_data(run):
    step = run / "checkpoints" / "step_2"
    ckpt.load_rank_rng(step, 0)  # NumPy's state is an array: allowed by name
    assert ckpt.load_scheduler_state(step)["last_epoch"] == 2


def test_a_planted_refcoco_refs_pickle_is_refused_by_name_and_never_runs(tmp_path):
    from _prepare_fixtures import refcoco

    from vlrft.data.prepare.refcoco import _load_refs

    source = refcoco(tmp_path / "raw")
    assert len(_load_refs(source)) == 6  # the plain file still loads (containers, strings, numbers)
    with (source / "refs(unc).p").open("wb") as handle:  # a Python 2 file (latin-1 strings) loads too
        pickle.dump([{"sent": "caf\xe9"}], handle, protocol=2)
    assert _load_refs(source) == [{"sent": "caf\xe9"}]
    marker = tmp_path / "payload-ran"
    with (source / "refs(unc).p").open("wb") as handle:
        pickle.dump([{"ref_id": 1, "sentences": Payload(marker)}], handle)
    with pytest.raises(UserError) as excinfo:
        _load_refs(source)
    message = one_line_error(excinfo)
    assert str(source / "refs(unc).p") in message and "open, which only code" in message
    assert not marker.exists()


def test_an_fsdp2_checkpoint_is_read_back_as_data_and_a_planted_metadata_file_is_refused(tmp_path):
    """torch.distributed.checkpoint unpickles `.metadata` and non-tensor values unchecked; `dcp_load` does not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from vlrft.parallel.safe_checkpoint import dcp_load

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"policy": {"model": weights, "optimizer": optim}}, checkpoint_id=str(tmp_path / "sharded"))
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=5.0)
    weights, optim = get_state_dict(other, other_optimizer)
    state = {"policy": {"model": weights, "optimizer": optim}}
    dcp_load(state, tmp_path / "sharded")
    set_state_dict(other, other_optimizer, model_state_dict=state["policy"]["model"],
                   optim_state_dict=state["policy"]["optimizer"])
    assert torch.equal(other.weight, model.weight)
    assert other_optimizer.param_groups[0]["lr"] == 1e-3 and other_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    marker = tmp_path / "payload-ran"
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UserError) as excinfo:
        dcp_load(state, tmp_path / "sharded")
    assert ".metadata" in one_line_error(excinfo) and "open, which only code" in str(excinfo.value)
    assert not marker.exists()


def test_deepspeed_checkpoint_files_are_checked_as_data_before_deepspeed_reads_them(tmp_path):
    deepspeed = pytest.importorskip("deepspeed")  # noqa: F841
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from vlrft.parallel.safe_checkpoint import check_deepspeed_files

    tag = tmp_path / "deepspeed" / "policy" / "state"
    tag.mkdir(parents=True)
    # what DeepSpeed's optimizer file holds besides tensors (seen in a ZeRO-3 checkpoint of a real run)
    torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                         "fp32": [torch.ones(3)]}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    check_deepspeed_files(tag)
    marker = tmp_path / "payload-ran"
    torch.save({"module": Payload(marker)}, tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(UserError) as excinfo:
        check_deepspeed_files(tag)
    assert "model_states.pt" in one_line_error(excinfo)
    assert not marker.exists()


# ------------------------------------------------------------------ damaged checkpoints

def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name", ["model/model.safetensors", "optimizer.pt", "rng/rank0.pt"])
def test_a_truncated_file_in_the_newest_checkpoint_is_named_in_one_line(run, tiny_vlm_dir, shapes, name):
    step = run / "checkpoints" / "step_2"
    _truncate(step / name)
    with pytest.raises(UserError) as excinfo:
        resume(run, tiny_vlm_dir, shapes)
    message = one_line_error(excinfo)
    assert f"checkpoint {step} is damaged: {name} has" in message and "truncated" in message
    assert "train.resume_fallback=true" in message


def test_a_corrupt_trainer_state_is_named_not_taken_for_an_unfinished_checkpoint(run, tiny_vlm_dir, shapes):
    step = run / "checkpoints" / "step_2"
    (step / ckpt.STATE_FILE).write_text("{not json" + " " * 400)
    with pytest.raises(UserError) as excinfo:
        resume(run, tiny_vlm_dir, shapes)
    assert f"checkpoint {step} is damaged: {ckpt.STATE_FILE}" in one_line_error(excinfo)


def test_a_deleted_optimizer_file_is_named_missing(run, tiny_vlm_dir, shapes):
    step = run / "checkpoints" / "step_2"
    (step / "optimizer.pt").unlink()
    with pytest.raises(UserError) as excinfo:
        resume(run, tiny_vlm_dir, shapes)
    message = one_line_error(excinfo)
    assert f"checkpoint {step} is damaged: optimizer.pt is missing" in message and "strategy" not in message


def test_changed_bytes_of_the_same_size_are_found_by_the_checksum(run, tiny_vlm_dir, shapes):
    path = run / "checkpoints" / "step_2" / "model" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="model/model.safetensors does not match its checksum"):
        resume(run, tiny_vlm_dir, shapes)


def test_with_resume_fallback_the_damaged_newest_is_named_and_the_one_before_resumed(run, tiny_vlm_dir, shapes,
                                                                                    capsys):
    step = run / "checkpoints" / "step_2"
    _truncate(step / "optimizer.pt")
    trainer = resume(run, tiny_vlm_dir, shapes, "train.resume_fallback=true")
    assert trainer.resume_from == run / "checkpoints" / "step_1" and trainer.step_count == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {step} is damaged: optimizer.pt has ")
    assert lines[0].endswith("(truncated or overwritten); skipping it (train.resume_fallback=true)")
    trainer.release_hold()
    (run / "checkpoints" / "step_1" / "scheduler.pt").unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        resume(run, tiny_vlm_dir, shapes, "train.resume_fallback=true")


def test_an_explicitly_named_damaged_checkpoint_is_refused_even_with_fallback(run, tiny_vlm_dir, shapes):
    step = run / "checkpoints" / "step_1"
    _truncate(step / "scheduler.pt")
    with pytest.raises(UserError, match=r"step_1 is damaged: scheduler.pt has .*resume from another checkpoint"):
        Trainer(config(run, tiny_vlm_dir(), shapes, "train.total_steps=3", f"train.resume={step}",
                       "train.resume_fallback=true"))


def test_a_checkpoint_written_before_manifests_resumes_with_a_warning_line(run, tiny_vlm_dir, shapes, capsys):
    step = run / "checkpoints" / "step_2"
    (step / manifest.MANIFEST).unlink()
    state = ckpt.load_trainer_state(step)
    del state["manifest"]
    (step / ckpt.STATE_FILE).write_text(json.dumps(state))
    trainer = resume(run, tiny_vlm_dir, shapes)
    assert trainer.resume_from == step and trainer.step_count == 2
    assert f"checkpoint {step} has no manifest.json" in capsys.readouterr().out
    trainer.release_hold()
    # one written by this version whose manifest is gone is damaged, not taken for an earlier version's
    state["manifest"] = manifest.FORMAT
    (step / ckpt.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(UserError, match="is damaged: manifest.json is missing"):
        resume(run, tiny_vlm_dir, shapes)


def test_the_cli_prints_a_damaged_checkpoint_as_one_line_and_exits_2(run, tiny_vlm_dir, shapes, capsys):
    (run / "checkpoints" / "step_2" / "optimizer.pt").unlink()
    code = main(["train", str(run / "config.yaml"), *overrides(run, tiny_vlm_dir(), shapes, "train.total_steps=3",
                                                                 "train.resume=auto")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "optimizer.pt is missing" in err[0], err


def test_a_relaunch_below_the_checkpoints_step_says_nothing_to_do_and_exits_0(run, tiny_vlm_dir, shapes, capsys):
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    code = main(["train", str(run / "config.yaml"), *overrides(run, tiny_vlm_dir(), shapes, "train.total_steps=1",
                                                                 "train.resume=auto")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert out == [f"nothing to do: checkpoint {run / 'checkpoints' / 'step_2'} is at step 2 and "
                   "train.total_steps=1; raise train.total_steps to train on from it"]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.exists()} == before  # nothing written or cleared


def test_a_damaged_temporary_save_does_not_replace_the_checkpoint_it_was_replacing(run):
    """A save of the same step cut short before its manifest: the old checkpoint goes back (crash leftovers)."""
    root = run / "checkpoints"
    shutil.copytree(root / "step_2", root / ".tmp-step_2")
    (root / ".tmp-step_2" / manifest.MANIFEST).unlink()  # killed before the manifest: incomplete
    os.replace(root / "step_2", root / ".old-step_2")
    ckpt.clear_crash_leftovers(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"] and manifest.verify(root / "step_2") is None

"""A full disk (or a read-only mount) outside a checkpoint write: config.yaml, metrics, TensorBoard, thumbnails.

`vlrft train` stops with one line naming the file and the way out, and gives the output folder's hold back. A full
disk cannot be made here (no tmpfs): `io.open` is patched so that the chosen files' writes fail with the errno.
"""

import errno
import io
import os
import re
from pathlib import Path

import pytest

from vlrft.cli import main
from vlrft.trainer.run_folder import HOLD_FILE

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"
FULL = "the disk is full (No space left on device); free space there or choose another train.output_dir"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=8, test_size=2))


class _FailingWrites(io.RawIOBase):
    """A file whose every write fails with `code`, as a full disk's does (the open itself succeeds)."""

    def __init__(self, code: int):
        self.code = code

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(self.code, os.strerror(self.code))


def fail_writes(monkeypatch, name: str, code: int = errno.ENOSPC, after: Path | None = None) -> None:
    """Writes to files whose name contains `name` fail with `code` (once `after` exists, when given)."""
    real_open = io.open

    def open_(file, mode="r", *args, **kwargs):
        if name in str(file) and any(c in mode for c in "wax+") and (after is None or after.exists()):
            real_open(file, mode, *args, **kwargs).close()  # the file is created, its contents never land
            raw = _FailingWrites(code)
            return raw if "b" in mode else io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_)


def train(tmp_path, model, shapes, capsys, *overrides) -> tuple[int, str]:
    (tmp_path / "run.yaml").write_text("{}\n")
    capsys.readouterr()  # the fixtures' own output
    code = main(["train", str(tmp_path / "run.yaml"), f"model.path={model}", "model.dtype=float32",
                 f"data.train_files=[{shapes['train']}]", "data.min_pixels=784", "data.max_pixels=3136", "rollout.n=4",
                 "rollout.global_batch_completions=8", "rollout.max_new_tokens=4", "train.lr=1e-3",
                 f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]", f"train.output_dir={tmp_path / 'run'}",
                 "train.total_steps=2", "train.save_every=0", "logging.progress=false", *overrides])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.splitlines()[-1]  # after the model loader's progress bar


def test_a_full_disk_when_config_yaml_is_written_is_one_line_and_frees_the_folder(tmp_path, tiny_vlm_dir, shapes,
                                                                                  capsys, monkeypatch):
    out = tmp_path / "run"
    fail_writes(monkeypatch, "config.yaml")
    code, err = train(tmp_path, tiny_vlm_dir(), shapes, capsys)
    assert code == 2
    assert err == f"vlrft train: error: cannot write '{out / 'config.yaml'}': {FULL}"
    assert not (out / HOLD_FILE).exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_disk_that_fills_during_training_stops_tensorboard_with_one_line(tmp_path, tiny_vlm_dir, shapes, capsys,
                                                                            monkeypatch):
    """TensorBoard writes from a thread: its failed write is no traceback there, and one line here."""
    out = tmp_path / "run"
    fail_writes(monkeypatch, "events.out.tfevents", after=out / "metrics.jsonl")  # step 1's scalars
    code, err = train(tmp_path, tiny_vlm_dir(), shapes, capsys, "logging.tensorboard=true")
    assert code == 2
    assert err == f"vlrft train: error: cannot write '{out / 'tensorboard'}': {FULL}"
    assert not (out / HOLD_FILE).exists()
    assert [line.count('"step": 1') for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
def test_a_read_only_metrics_file_is_one_line_naming_it(tmp_path, tiny_vlm_dir, shapes, capsys, monkeypatch):
    out = tmp_path / "run"
    fail_writes(monkeypatch, "metrics.jsonl", code=errno.EROFS)
    code, err = train(tmp_path, tiny_vlm_dir(), shapes, capsys, "logging.tensorboard=false")
    assert code == 2
    assert err == (f"vlrft train: error: cannot write '{out / 'metrics.jsonl'}': the file system is read-only "
                   "(Read-only file system); choose a writable train.output_dir")
    assert not (out / HOLD_FILE).exists()


def test_write_failed_names_the_file_why_and_the_fix():
    from vlrft.errors import write_failed

    assert str(write_failed("/r/x", OSError(errno.EDQUOT, "Disk quota exceeded"))) == (
        "cannot write '/r/x': the disk quota is used up (Disk quota exceeded); free space there or choose another "
        "train.output_dir")
    assert str(write_failed("/r", OSError(errno.EACCES, "Permission denied", "/r/y"))) == (
        "cannot write '/r/y': permission denied (Permission denied); choose a writable train.output_dir")
    assert str(write_failed("/r/z", OSError(errno.EIO, "Input/output error"))) == (
        "cannot write '/r/z': the write failed (Input/output error); choose a writable train.output_dir")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_run_logger_makes_a_failed_tensorboard_write_one_line_and_closes(tmp_path, monkeypatch):
    import threading

    from vlrft.config import load_config
    from vlrft.errors import UserError
    from vlrft.logging import CompletionRow, RunLogger, read_metrics

    cfg = load_config(None, ["logging.progress=false", "logging.tensorboard=true"], validate=False)
    hook = threading.excepthook
    logger = RunLogger(cfg, tmp_path, total_steps=3)
    logger.log(1, {"reward/mean": 0.5})
    fail_writes(monkeypatch, "events.out.tfevents")
    with pytest.raises(UserError, match=re.escape(f"cannot write '{tmp_path / 'tensorboard'}': {FULL}")):
        logger.log(2, {"reward/mean": 0.25})  # TensorBoard's thread writes: its failure is raised by this call or,
        logger.log(3, {"reward/mean": 0.125})  # when it set it a moment after this call's flush, by the next one
    logger.close()  # nothing more to raise: TensorBoard was closed at the failure
    assert threading.excepthook is hook
    assert [r["step"] for r in read_metrics(tmp_path)][:2] == [1, 2]
    fail_writes(monkeypatch, "completions.jsonl")
    with pytest.raises(UserError, match=re.escape(f"cannot write '{tmp_path / 'completions.jsonl'}': {FULL}")):
        logger.log_completions(4, [CompletionRow(prompt="p", completion="c", rewards={"r": 1.0}, advantage=0.5)])

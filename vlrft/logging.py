"""Run tracking on the main rank: metrics.jsonl, TensorBoard event files, wandb, completion tables, progress.

Metrics arrive already reduced over ranks (the trainer reduces sums and counts); only rank 0
builds a `RunLogger`. wandb is imported only when `logging.wandb` is on; its API key comes from the
WANDB_API_KEY variable or the config and is never written to disk by vlrft.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlrft.config import Config, LoggingConfig, to_dict
from vlrft.errors import MissingDependencyError, write_failed

# metric -> its short name in the progress bar
HEADLINE = {"reward/mean": "reward", "eval/accuracy": "eval_acc", "kl": "kl", "entropy": "entropy",
            "completions/mean_length": "len"}


@dataclass
class CompletionRow:
    """One line of a completion table."""

    prompt: str
    completion: str
    rewards: dict[str, float | None]
    advantage: float
    image: str | None = None  # path of a thumbnail written next to the table
    extra: dict[str, Any] = field(default_factory=dict)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@contextlib.contextmanager
def _writing(path: Path):
    """A failed write of `path` (a full disk, a read-only mount) as one line naming the file and the way out."""
    try:
        yield
    except OSError as exc:
        raise write_failed(path, exc) from exc


class RunLogger:
    """Writes every tracker the config asks for; call `log(step, metrics)` once per step on rank 0.

    A file it cannot write (a full disk, a read-only mount) is a `UserError` naming the file, never a traceback."""

    def __init__(self, cfg: Config, output_dir: str | Path, total_steps: int, start_step: int = 0,
                 run_id: str | None = None):
        self.cfg: LoggingConfig = cfg.logging
        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.completions_path = self.dir / "completions.jsonl"
        self.tb_dir = self.dir / "tensorboard"
        with _writing(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
            _truncate_after(self.metrics_path, start_step)  # a resumed run rewrites the steps after its checkpoint
            _truncate_after(self.completions_path, start_step)
        self._tb = None
        if self.cfg.tensorboard:
            self._open_tensorboard()
        self._wandb = self._init_wandb(cfg, run_id) if self.cfg.wandb else None
        self._bar = None
        if self.cfg.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="vlrft", dynamic_ncols=True)

    def _init_wandb(self, cfg: Config, run_id: str | None):
        """One wandb run per run lineage: a resumed run continues the run it resumes (id `vlrft-<run_id>`, kept in
        every checkpoint's trainer state), unless WANDB_RUN_ID names another. wandb ignores steps it already has
        (those logged after the checkpoint by the run that stopped) and logs on from the next one."""
        try:
            import wandb
        except ImportError as exc:
            raise MissingDependencyError(f"logging.wandb=true needs the package 'wandb' ({exc}); install it with: "
                                         "pip install 'vlrft[wandb]'") from exc
        if self.cfg.wandb_api_key and not os.environ.get("WANDB_API_KEY"):
            os.environ["WANDB_API_KEY"] = self.cfg.wandb_api_key
        run = os.environ.get("WANDB_RUN_ID") or (f"vlrft-{run_id}" if run_id else None)
        return wandb.init(project=self.cfg.wandb_project, name=self.cfg.wandb_run_name, dir=str(self.dir),
                          config=to_dict(cfg, redact_secrets=True), id=run, resume="allow")

    def _open_tensorboard(self) -> None:
        """One event file, rewritten from the jsonl logs on every (re)start: they are what survived a crash, and
        several event files of killed runs can be read back out of order (their names sort by the second and pid
        they were created in), which hid steps from TensorBoard."""
        from torch.utils.tensorboard import SummaryWriter

        with _writing(self.tb_dir):
            for old in self.tb_dir.glob("events.out.tfevents.*"):
                old.unlink()
            self._tb = SummaryWriter(log_dir=str(self.tb_dir))
        # TensorBoard writes from a thread, which prints the traceback of a failed write; the writer raises it again
        # on our next call, where `_tb_write` makes it one line.
        self._thread_hook = threading.excepthook
        threading.excepthook = self._tensorboard_thread_failed
        self._tb_write(self._replay_tensorboard)

    def _tensorboard_thread_failed(self, args) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            self._thread_hook(args)

    def _tb_write(self, write) -> None:
        """`write()` to TensorBoard, then flush; a failed write (here or in its writer thread) is one `UserError`,
        after which TensorBoard is closed."""
        try:
            write()
            self._tb.flush()
        except OSError as exc:
            self._close_tensorboard()
            raise write_failed(self.tb_dir, exc) from exc

    def _close_tensorboard(self) -> None:
        tb, self._tb = self._tb, None
        with contextlib.suppress(OSError):  # already failed: raised once, by `_tb_write`
            tb.close()
        if threading.excepthook == self._tensorboard_thread_failed:
            threading.excepthook = self._thread_hook

    def _replay_tensorboard(self) -> None:
        """The steps kept in metrics.jsonl / completions.jsonl (a resumed run's steps up to its checkpoint)."""
        for record in _records(self.metrics_path) if self.metrics_path.exists() else []:
            self._tb_scalars(record.get("step", 0), record)
        by_step: dict[int, list[dict]] = {}
        for row in _records(self.completions_path) if self.completions_path.exists() else []:
            by_step.setdefault(row.get("step", 0), []).append(row)
        for step, rows in by_step.items():
            self._tb.add_text("completions", _completions_markdown(rows), step)

    def _tb_scalars(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with _writing(self.metrics_path), self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb_write(lambda: self._tb_scalars(step, metrics))
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({short: f"{metrics[key]:.3g}" for key, short in HEADLINE.items()
                                   if isinstance(metrics.get(key), (int, float))}, refresh=True)

    def log_completions(self, step: int, rows: list[CompletionRow]) -> None:
        records = [{"step": step, "prompt": row.prompt, "completion": row.completion,
                    "rewards": {k: _clean(v) for k, v in row.rewards.items()},
                    "advantage": _clean(row.advantage), "image": row.image, **row.extra} for row in rows]
        with _writing(self.completions_path), self.completions_path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(record) + "\n" for record in records))
        if self._tb is not None:
            self._tb_write(lambda: self._tb.add_text("completions", _completions_markdown(records), step))
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "completion", "rewards", "advantage"])
            for row in rows:
                steps = row.extra.get("trajectory")
                shown = "\n".join(trajectory_lines(steps)) if isinstance(steps, list) else row.completion
                table.add_data(step, row.prompt, shown, json.dumps(row.rewards), row.advantage)
            self._wandb.log({"completions": table}, step=step)

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        try:
            if self._tb is not None:
                self._tb_write(lambda: None)  # a failed write of the last step, raised by the flush
                self._close_tensorboard()
        finally:
            if self._wandb is not None:
                self._wandb.finish()


def _completions_markdown(records: list[dict]) -> str:
    """A TensorBoard text table of completions.jsonl records; a multi-turn row shows its whole trajectory."""
    header = "| prompt | image | completion | rewards | advantage |\n|---|---|---|---|---|\n"
    return header + "".join(
        f"| {_md(str(r.get('prompt', ''))[-200:])} | {r.get('image') or ''} | {_completion_cell(r)} | "
        f"{_md(json.dumps(r.get('rewards', {})))} | {float(r.get('advantage') or 0.0):.3f} |\n" for r in records)


def _completion_cell(record: dict) -> str:
    steps = record.get("trajectory")
    if not isinstance(steps, list):
        return _md(str(record.get("completion", ""))[:300])
    head = f"({record.get('turns', '?')} turns, {record.get('finish_reason', '?')})"
    return "<br>".join([head, *(_md(line) for line in trajectory_lines(steps))])


def trajectory_lines(steps: list[dict], width: int = 300) -> list[str]:
    """A multi-turn trajectory (`vlrft.rollout.Rollouts.transcripts`) as readable lines: each model turn,
    each tool call with its status, its images as [image] placeholders and the text the model read."""
    lines = []
    for step in steps:
        text = str(step.get("text", ""))
        text = text if len(text) <= width else text[:width] + " ..."
        if step.get("role") != "tool":
            lines.append(f"[model] {text}")
            continue
        call = step.get("call")
        name = f"{call.get('name')} {json.dumps(call.get('arguments'))}" if isinstance(call, dict) else "(unread call)"
        status = step.get("status", "ok") + ("" if step.get("shown", True) else ", not shown")
        reward = "" if step.get("reward") is None else f", reward {step['reward']}"
        lines.append(f"[tool {name}: {status}{reward}] " + "[image] " * int(step.get("images") or 0) + text)
    return lines


def _md(text: str) -> str:
    """One table cell's text: pipes escaped, on one line, and tags (`<tool_call>`) shown, not read as HTML."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|").replace("\n", " ")


def _truncate_after(path: Path, step: int) -> None:
    """Drop lines of a jsonl log whose step is after `step` (they belong to work lost in a crash)."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    kept = [json.dumps(record) for record in _records(path) if record.get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _records(path: Path) -> list[dict]:
    """The JSON lines of a log; a line torn by a crash mid-write (not valid JSON) is dropped."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(output_dir: str | Path) -> list[dict]:
    """The metrics.jsonl records of a run, in order (a torn last line from a crash is skipped)."""
    return _records(Path(output_dir) / "metrics.jsonl")

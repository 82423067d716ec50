"""The bad-input catalogue: every malformed input ends in one line naming the file/row/field or key, no traceback.

Each case builds its input in a fresh folder, runs the real CLI entry point in-process (`vlrft.cli.main`),
and checks the exit status, that stderr is exactly one line holding the expected fragments and no
traceback, and that nothing was written anywhere but the run's output folder (the media-check cache
lives in $VLRFT_CACHE_DIR by design and is excluded). Reward-server requests go to the real aiohttp app.
The README's "Bad input and faults" table lists these cases.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from _data_helpers import png_with_huge_icc_profile
from vlrft.cli import main

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@dataclass
class Case:
    argv: list[str]
    code: int
    fragments: tuple[str, ...]


def png(size=(28, 28), value=90, fmt="PNG", mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, value if mode != "RGB" else (value, value, value)).save(buffer, fmt)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    data = bytearray(png((4, 4)))
    ihdr = data[12:29]
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def noisy(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


GOOD_ROW = {"prompt": "<image>What colour?", "images": ["good.png"], "answer": "red"}


class Inputs:
    """Writes one case's files under `root/in`; the run folder is `root/run`."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        self.dir = root / "in"
        self.dir.mkdir()
        self.run = root / "run"
        (self.dir / "good.png").write_bytes(png())

    def file(self, name: str, content: bytes | str) -> str:
        path = self.dir / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def jsonl(self, *rows, name="bad.jsonl") -> str:
        """A good first row, then `rows` (dicts are JSON-encoded, bytes written as they are)."""
        lines = [json.dumps(GOOD_ROW).encode()] + [r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows]
        return self.file(name, b"\n".join(lines) + b"\n")

    def image_row(self, name: str, content: bytes) -> str:
        self.file(name, content)
        return self.jsonl({"prompt": "<image>What colour?", "images": [name], "answer": "red"})

    def config(self, *overrides: str, data: str | None = None, **sections) -> list[str]:
        cfg = {"model": {"path": str(self.model), "dtype": "float32"},
               "data": {"train_files": [data or self.jsonl()], "min_pixels": 784, "max_pixels": 3136},
               "rollout": {"n": 2, "global_batch_completions": 4, "max_new_tokens": 3},
               "reward": {"functions": [{"name": f"{REWARDS}:text_hash"}]},
               "train": {"output_dir": str(self.run), "total_steps": 1, "micro_batch_completions_per_rank": 4},
               "logging": {"progress": False, "completions_every": 0, "tensorboard": False}}
        for section, values in sections.items():
            cfg[section].update(values)
        return [self.file("config.yaml", yaml.safe_dump(cfg)), *overrides]

    def train(self, *overrides: str, data: str | None = None, **sections) -> list[str]:
        return ["train", *self.config(*overrides, data=data, **sections)]


def row(prompt="<image>What colour?", images=("good.png",), answer="red", **extra):
    return {"prompt": prompt, "images": list(images), "answer": answer, **extra}


ROW_AT_2 = "bad.jsonl line 2"
# id -> (builder(inputs) -> argv, exit code, fragments stderr must hold[, mock(monkeypatch)])
CASES = {
    # ---- data rows (found before any model loads)
    "row: invalid JSON": (lambda i: i.train(data=i.jsonl(b'{"prompt": "x",')), 2, (ROW_AT_2, "not valid JSON")),
    "row: non-UTF-8 byte": (lambda i: i.train(data=i.jsonl(b'{"prompt": "caf\xe9"}')), 2, (ROW_AT_2, "UTF-8")),
    "row: a list, not an object": (lambda i: i.train(data=i.jsonl([1, 2])), 2, (ROW_AT_2, "<row>", "got list")),
    "row: prompt null": (lambda i: i.train(data=i.jsonl(row(prompt=None))), 2, (ROW_AT_2, "'prompt'")),
    "row: prompt a number": (lambda i: i.train(data=i.jsonl(row(prompt=5))), 2, (ROW_AT_2, "'prompt'")),
    "row: chat message without role": (lambda i: i.train(data=i.jsonl(row(prompt=[{"content": "hi"}], images=[]))),
                                       2, (ROW_AT_2, "prompt[0]", "'role'")),
    "row: unknown chat role": (lambda i: i.train(data=i.jsonl(row(prompt=[{"role": "robot", "content": "hi"}],
                                                                   images=[]))), 2, (ROW_AT_2, "prompt[0].role")),
    "row: answer is a mapping": (lambda i: i.train(data=i.jsonl(row(answer={"a": 1}))), 2, (ROW_AT_2, "'answer'")),
    "row: more placeholders than images": (lambda i: i.train(data=i.jsonl(row(prompt="<image><image>Which?"))), 2,
                                           ("data.train_files", ROW_AT_2, "2 <image> placeholder")),
    "row: empty prompt": (lambda i: i.train(data=i.jsonl(row(prompt="<image>"))), 2, (ROW_AT_2, "empty")),
    "row: image file missing": (lambda i: i.train(data=i.jsonl(row(images=["nope.png"]))), 2,
                                (ROW_AT_2, "images[0]", "not found")),
    "row: remote image URL": (lambda i: i.train(data=i.jsonl(row(images=["https://x.org/a.png"]))), 2,
                              (ROW_AT_2, "images[0]", "remote image")),
    "row: data URI not base64": (lambda i: i.train(data=i.jsonl(row(images=["data:image/png;base64,@@@"]))), 2,
                                 (ROW_AT_2, "images[0]", "base64")),
    "row: verl reward_model not a mapping": (
        lambda i: i.train(data=i.file("v.jsonl", json.dumps({"prompt": [{"role": "user", "content": "hi"}],
                                                             "data_source": "m", "reward_model": "2"}) + "\n")),
        2, ("v.jsonl line 1", "reward_model")),
    "file: unknown columns": (lambda i: i.train(data=i.file("c.jsonl", '{"question": "hi"}\n')), 2,
                              ("c.jsonl", "cannot tell the dataset layout")),
    "file: not found": (lambda i: i.train(data=str(i.dir / "missing.jsonl")), 2, ("missing.jsonl", "not found")),
    "file: unknown type": (lambda i: i.train(data=i.file("d.csv", "a,b\n")), 2, ("d.csv", "unknown file type")),
    "file: JSON not a list": (lambda i: i.train(data=i.file("d.json", '{"prompt": "x"}')), 2,
                              ("d.json", "JSON list")),
    "file: corrupt parquet": (lambda i: i.train(data=i.file("d.parquet", b"PAR1garbage")), 2,
                              ("d.parquet", "cannot read parquet")),
    "file: empty": (lambda i: i.train(data=i.file("e.jsonl", "")), 2, ("data.train_files", "no samples")),
    # ---- media files (every container, corrupt or hostile)
    **{f"media: truncated {fmt}": (lambda i, fmt=fmt: i.train(data=i.image_row(f"t.{fmt.lower()}",
                                                                                noisy(fmt)[:200])), 2,
                                   (ROW_AT_2, "images[0]"))
       for fmt in ("PNG", "JPEG", "WEBP", "TIFF", "GIF", "BMP")},
    "media: zero-byte file": (lambda i: i.train(data=i.image_row("z.png", b"")), 2, (ROW_AT_2, "images[0]")),
    "media: text named .png": (lambda i: i.train(data=i.image_row("t.png", b"hello")), 2,
                               (ROW_AT_2, "images[0]", "not an image file")),
    "media: decompression bomb": (lambda i: i.train(data=i.image_row("b.png", png_claiming(20000, 20000))), 2,
                                  (ROW_AT_2, "images[0]", "decompression bomb")),
    "media: over max_source_pixels": (lambda i: i.train(data=i.image_row("h.png", png_claiming(10000, 10000))), 2,
                                      (ROW_AT_2, "images[0]", "data.max_source_pixels")),
    "media: aspect ratio 300:1": (lambda i: i.train(data=i.image_row("w.png", png((3000, 10)))), 2,
                                  (ROW_AT_2, "images[0]", "aspect ratio")),
    # ---- configs
    "config: file missing": (lambda i: ["train", str(i.dir / "none.yaml")], 2, ("none.yaml", "not found")),
    "config: invalid YAML": (lambda i: ["train", i.file("c.yaml", "train: [1,\n")], 2, ("c.yaml", "line")),
    "config: a list at the top": (lambda i: ["train", i.file("c.yaml", "- 1\n")], 2, ("c.yaml", "mapping")),
    "config: unknown key": (lambda i: i.train("train.lrr=1"), 2, ("train.lrr", "did you mean 'train.lr'")),
    "config: wrong type": (lambda i: i.train("rollout.n=many"), 2, ("rollout.n", "an integer")),
    "config: override without =": (lambda i: i.train("train.lr"), 2, ("train.lr", "section.key=value")),
    "config: lr nan": (lambda i: i.train("train.lr=nan"), 2, ("train.lr", "finite")),
    "config: lr inf": (lambda i: i.train("train.lr=inf"), 2, ("train.lr", "finite")),
    "config: negative temperature": (lambda i: i.train("rollout.temperature=-1"), 2, ("rollout.temperature",)),
    "config: top_p > 1": (lambda i: i.train("rollout.top_p=1.5"), 2, ("rollout.top_p", "(0, 1]")),
    "config: top_k < -1": (lambda i: i.train("rollout.top_k=-3"), 2, ("rollout.top_k",)),
    "config: batch not a multiple of n": (lambda i: i.train("rollout.global_batch_completions=5"), 2,
                                          ("rollout.global_batch_completions", "multiple of rollout.n")),
    "config: resume path missing": (lambda i: i.train(f"train.resume={i.dir / 'ckpt'}"), 2, ("train.resume",)),
    "config: overwrite and resume": (lambda i: i.train("train.overwrite=true", "train.resume=auto"), 2,
                                     ("train.overwrite", "contradict")),
    "config: used output folder": (lambda i: (i.run.mkdir(), (i.run / "metrics.jsonl").write_text("{}\n"),
                                              i.train())[-1], 2,
                                   ("train.output_dir", "train.resume=auto", "train.overwrite=true")),
    "config: ddp without torchrun": (lambda i: i.train("train.strategy=ddp"), 2, ("torchrun --nproc_per_node",)),
    "config: no training files": (lambda i: i.train("data.train_files=[]"), 2, ("data.train_files",)),
    "config: reward weight nan": (lambda i: i.train("reward.functions=[{name: accuracy, weight: .nan}]"), 2,
                                  ("reward.functions[0].weight", "finite")),
    # ---- reward functions
    "reward: unknown name": (lambda i: ["reward-server", "--functions", "acuracy"], 2, ("acuracy",)),
    "reward: file missing": (lambda i: ["reward-server", "--functions", f"{i.dir / 'r.py'}:f"], 2, ("r.py",)),
    "reward: function missing in file": (lambda i: ["reward-server", "--functions", f"{REWARDS}:nope"], 2,
                                         ("nope",)),
    "reward: file with a syntax error": (lambda i: ["reward-server", "--functions",
                                                    f"{i.file('r.py', 'def f(:')}:f"], 2, ("r.py",)),
    "reward: weight not a number": (lambda i: ["reward-server", "--functions", "accuracy=heavy"], 2,
                                    ("accuracy=heavy", "not a number")),
    "reward: raises while training": (
        lambda i: i.train(reward={"functions": [{"name": f"{REWARDS}:broken"}]}), 2,
        ("reward function 'broken'", "grader crashed", "reward.on_error=none")),
    # ---- generate
    "generate: corrupt image": (lambda i: ["generate", str(i.model), "hi", "--image", i.file("c.png", noisy("PNG")[:99])],
                                2, ("--image", "c.png")),
    "generate: image missing": (lambda i: ["generate", str(i.model), "hi", "--image", str(i.dir / "no.png")], 2,
                                ("--image", "no.png")),
    "generate: model folder without config": (lambda i: ["generate", str(i.dir), "hi"], 2, ("config.json",)),
    # ---- issue 31: each class of what a user's file, config or function can raise
    "config: a key given twice": (lambda i: ["train", i.file("c.yaml", "train: {lr: 1.0e-6}\nmodel: {}\ntrain: "
                                                                      "{lr: 1.0}\n")], 2,
                                  ("c.yaml", "key 'train' is given twice", "lines 1 and 3")),
    "config: not UTF-8": (lambda i: ["train", i.file("c.yaml", b"train:\n  output_dir: caf\xe9\n")], 2,
                          ("c.yaml", "not UTF-8", "line 2")),
    "config: anchor inside its own value": (lambda i: ["train", i.file("c.yaml", "train: &t\n  inner: *t\n")], 2,
                                            ("c.yaml", "'train.inner'", "YAML anchor")),
    "config: list override past the end": (lambda i: i.train("reward.functions.3.weight=2"), 2,
                                           ("reward.functions.3.weight=2", "has 1 entries", "reward.functions=[...]")),
    "config: list override by name": (lambda i: i.train("data.train_files.first=x"), 2,
                                      ("'data.train_files' is a list", "index it by number")),
    "config: eval_batch_prompts 0": (lambda i: i.train("train.eval_batch_prompts=0"), 2,
                                     ("train.eval_batch_prompts=0", "a positive integer")),
    "config: eval_batch_prompts -1": (lambda i: i.train("train.eval_batch_prompts=-1"), 2,
                                      ("train.eval_batch_prompts=-1", "a positive integer")),
    "config: total_steps -1": (lambda i: i.train("train.total_steps=-1"), 2, ("train.total_steps=-1", ">= 0")),
    "config: eval_every -1": (lambda i: i.train("train.eval_every=-1"), 2, ("train.eval_every=-1", ">= 0")),
    "config: log_every -1": (lambda i: i.train("logging.log_every=-1"), 2, ("logging.log_every=-1", "positive")),
    "media: ICC profile inflating past Pillow's limit": (
        lambda i: i.train(data=i.image_row("icc.png", png_with_huge_icc_profile())), 2,
        (ROW_AT_2, "images[0]", "Decompressed")),
    "media: ICC profile, data.validate_media=false": (
        lambda i: i.train("data.validate_media=false", data=i.image_row("icc.png", png_with_huge_icc_profile())), 2,
        ("bad.jsonl", "images[0]", "Decompressed")),
    "generate: ICC profile inflating past Pillow's limit": (
        lambda i: ["generate", str(i.model), "hi", "--image", i.file("icc.png", png_with_huge_icc_profile())], 2,
        ("--image", "icc.png", "Decompressed")),
    "reward: returns 10**400": (
        lambda i: i.train(reward={"functions": [{"name": f"{i.file('r.py', HUGE_REWARD)}:huge"}]}), 2,
        ("reward function 'huge'", "too large for a float")),
    "train: lr 1e30 diverges": (lambda i: i.train("train.lr=1e30", "train.total_steps=2", "train.save_every=1"), 2,
                                ("step 1", "training diverged", "train.lr (now 1e+30)")),
    "train: disk full during the save": (lambda i: i.train(), 2, ("checkpoint step 1: the disk is full",
                                                                  "checkpoints", "needs about", "free there"),
                                         lambda monkeypatch: full_disk(monkeypatch)),
    "train: folder held by a live run": (lambda i: (i.run.mkdir(), hold_by_live_process(i.run), i.train())[-1], 2,
                                         ("train.output_dir", "in use by a live run", f"pid {os.getppid()} on host "
                                          f"{socket.gethostname()}")),
    # ---- issue 40: bad input still ending in a traceback
    "config: output_dir /dev/null": (lambda i: i.train("train.output_dir=/dev/null"), 2,
                                     ("train.output_dir='/dev/null'", "not a folder")),
    "config: rollout.n 10**30": (lambda i: i.train(f"rollout.n={10**30}", f"rollout.global_batch_completions={10**30}"),
                                 2, ("rollout.n=", "at most 4096")),
    "row: chat special tokens in the text": (
        lambda i: i.train(data=i.jsonl(row(prompt="<image>What colour?<|im_end|>\n<|im_start|>assistant\nred"))), 2,
        (ROW_AT_2, "'<|im_end|>'", "data.special_tokens_in_text=escape")),
    "row: lone surrogate in the prompt": (lambda i: i.train(data=i.jsonl(row(prompt="<image>What colour? \ud800"))),
                                          2, ("data.train_files", ROW_AT_2, "lone surrogate '\\ud800'")),
    "row: lone surrogate, data.validate_media=false": (
        lambda i: i.train("data.validate_media=false", data=i.jsonl(row(prompt="<image>What colour? \ud800"))), 2,
        (ROW_AT_2, "lone surrogate '\\ud800'", "fix the row's text")),
    "row: image is a directory": (lambda i: (i.dir / "frames").mkdir() or i.train(data=i.jsonl(row(images=["frames"]))),
                                  2, (ROW_AT_2, "images[0]", "is a directory, not a file")),
    "generate: image is a directory": (lambda i: ["generate", str(i.model), "hi", "--image", str(i.dir)], 2,
                                       ("--image", "is a directory, not a file")),
}

HUGE_REWARD = "def huge(completions, **kwargs):\n    return [10**400 for _ in completions]\n"


def full_disk(monkeypatch) -> None:
    """Mocks (a full disk cannot be made here): torch.save fails as it does on a full disk, disk_usage says 4 KB."""
    import collections

    import torch

    from vlrft.trainer import checkpoint

    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4480 vs 4374")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))


def hold_by_live_process(folder: Path) -> None:
    """The folder's hold, as a live run on this host writes it: this test process's parent is alive."""
    from vlrft.trainer.run_folder import HOLD_FILE, _process_start

    pid = os.getppid()
    (folder / HOLD_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                                "process_start": _process_start(pid), "started": 0, "heartbeat": 0}))


def _tree(root: Path, skip: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and skip not in p.parents}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_ends_in_one_line(name, tmp_path, tiny_vlm_dir, capsys, monkeypatch):
    builder, code, fragments, *mocks = CASES[name]
    for mock in mocks:
        mock(monkeypatch)
    monkeypatch.setenv("VLRFT_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    inputs = Inputs(tmp_path, Path(tiny_vlm_dir()))
    argv = builder(inputs)
    capsys.readouterr()
    before = _tree(tmp_path, tmp_path / "run")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as `vlrft` run from a shell does (its env is set before transformers loads)
    try:
        status = main(argv)
    finally:
        hf_logging.enable_progress_bar()
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert status == code, (status, out.err)
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err + out.out
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    after = {k: v for k, v in _tree(tmp_path, tmp_path / "run").items() if "/cache/" not in k}
    assert after == {k: v for k, v in before.items() if "/cache/" not in k}, "wrote outside the run folder"
    checkpoints = tmp_path / "run" / "checkpoints"  # and no checkpoint, whole or half-written (a diverged step, a
    assert not checkpoints.exists() or not list(checkpoints.iterdir()), list(checkpoints.iterdir())  # full disk)


# ---- reward-server requests, against the real aiohttp application

REQUESTS = {
    "request: labels hold a list": ({"completions": ["a"], "labels": [["x"]]}, "application/json", 400, "labels[0]"),
    "request: JSON nested 100k deep": ("[" * 100_000 + "]" * 100_000, "application/json", 400, "nested too deeply"),
    "request: text/plain body": ({"completions": ["a"]}, "text/plain", 415, "application/json"),
    "request: invalid JSON": ('{"completions": [', "application/json", 400, "not valid JSON"),
    "request: completions not a list": ({"completions": "a"}, "application/json", 400, "'completions'"),
    "request: references of the wrong length": ({"completions": ["a", "b"], "references": ["a"]}, "application/json",
                                                400, "'references'"),
    "request: image not base64": ({"completions": ["a"], "images": ["@@"], "image_index": [[0]]}, "application/json",
                                  400, "images[0]"),
    "request: image index out of range": ({"completions": ["a"], "image_index": [[3]]}, "application/json", 400,
                                          "image_index[0]"),
    "request: wrong API key": ({"completions": ["a"]}, "application/json", 401, "API key"),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_bad_reward_server_request_gets_a_reason(name):
    from aiohttp.test_utils import TestClient, TestServer

    from vlrft.config import RewardConfig, RewardFunctionConfig
    from vlrft.rewards import RewardSet
    from vlrft.rewards.server import build_app

    body, content_type, status, fragment = REQUESTS[name]
    app = build_app(RewardSet.from_config(RewardConfig(functions=[RewardFunctionConfig(name="accuracy")])), "key")
    key = "wrong" if status == 401 else "key"

    async def post():
        async with TestClient(TestServer(app)) as client:
            data = json.dumps(body) if isinstance(body, dict) else body
            response = await client.post("/score", data=data, headers={"Content-Type": content_type,
                                                                       "Authorization": f"Bearer {key}"})
            return response.status, await response.json()

    got, answer = asyncio.run(post())
    assert got == status and fragment in answer["error"], (got, answer)


def test_the_catalogue_is_at_least_forty_inputs():
    assert len(CASES) + len(REQUESTS) >= 40
